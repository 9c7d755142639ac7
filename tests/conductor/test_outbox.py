"""``Outbox``: a reader whose outputs are always there still hears its own cancel."""

from __future__ import annotations

import anyio
import pytest

from mstar_async.conductor.checkpoints import CANCEL_CHECK_EVERY
from mstar_async.conductor.outbox import Outbox

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

QUEUED = 10 * CANCEL_CHECK_EVERY


async def test_a_reader_that_never_waits_still_sees_its_own_cancel() -> None:
    box = Outbox(QUEUED)
    for item in range(QUEUED):
        assert box.try_put(item)
    taken = []
    with anyio.CancelScope() as scope:
        while True:
            taken.append(await box.get())
            if len(taken) == 3:
                scope.cancel()
    # Without a look at its scope the reader would run on until the queue ran dry.
    assert scope.cancelled_caught
    assert 3 <= len(taken) <= CANCEL_CHECK_EVERY
    assert taken == list(range(len(taken)))  # in order, and nothing taken was lost
    assert box.buffered == QUEUED - len(taken)
