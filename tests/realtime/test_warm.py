"""The warm prefill's bookkeeping (``realtime/warm.py``): at most one warm request of a session
at a time, wishes made meanwhile coalescing into one more run with the latest turn, ``stop``
cancelling without waiting, ``discard`` dropping what was warmed only after the request in flight
has ended; and the server's side: no warm while the model is at its in-flight bound."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.realtime.config import SessionConfig
from mstar_async.realtime.warm import Warmer, WarmTurn
from mstar_async.server.admission import Admission
from mstar_async.server.realtime import _warmer

pytestmark = pytest.mark.timeout(30)


class Model:
    """A fake model's warm requests: each records its start and end and runs until
    ``release`` (or its cancellation); ``turn`` is what the session would warm now."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.running = 0
        self.most = 0
        self.turn: WarmTurn | None = WarmTurn([], SessionConfig())
        self.gate = anyio.Event()
        self.opened = False  # requests end at once
        self.asked = 0

    def prompt(self) -> WarmTurn | None:
        self.asked += 1
        return self.turn

    async def warm(self, turn: WarmTurn | None, request_id: str) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        self.log.append(("start", request_id))
        try:
            if not self.opened:
                await self.gate.wait()
        finally:
            self.running -= 1
            self.log.append(("end", request_id))

    def release(self) -> None:
        self.gate.set()
        self.gate = anyio.Event()

    def warmer(self, tg: Any) -> Warmer:
        """A session's warmer whose requests are this model's."""
        return Warmer(self.warm, tg, self.prompt, "s-warm")


async def settle(holds: Any) -> None:
    """Wait (2 s at most) until ``holds()``: the warmer's task runs on the same loop."""
    with anyio.fail_after(2):
        while not holds():
            await anyio.lowlevel.checkpoint()


@pytest.mark.anyio
async def test_wishes_made_during_a_warm_coalesce_into_one_more_run() -> None:
    model = Model()
    async with anyio.create_task_group() as tg:
        warmer = model.warmer(tg)
        warmer.want()
        await settle(lambda: model.running == 1)
        for _ in range(3):  # the encoder finished rows, the conversation changed, ...
            warmer.want()
        model.release()
        await settle(lambda: len(model.log) == 3)
        model.release()
        await settle(lambda: len(model.log) == 4)
    assert model.log == [
        ("start", "s-warm-1"),
        ("end", "s-warm-1"),
        ("start", "s-warm-2"),
        ("end", "s-warm-2"),
    ]
    assert model.most == 1


@pytest.mark.anyio
async def test_stop_cancels_the_warm_without_waiting_and_keeps_what_it_warmed() -> None:
    model = Model()
    async with anyio.create_task_group() as tg:
        warmer = model.warmer(tg)
        warmer.want()
        await settle(lambda: model.running == 1)
        warmer.want()  # due after it: stopped too
        warmer.stop()  # synchronous: the response that stops it starts at once
        assert model.running == 1
        await settle(lambda: model.running == 0)
    assert model.log == [("start", "s-warm-1"), ("end", "s-warm-1")]  # and no drop


@pytest.mark.anyio
async def test_discard_drops_what_was_warmed_once_the_warm_has_ended() -> None:
    model = Model()
    async with anyio.create_task_group() as tg:
        warmer = model.warmer(tg)
        warmer.discard()  # nothing warmed yet: nothing to drop
        warmer.want()
        await settle(lambda: model.running == 1)
        warmer.discard()
        await settle(lambda: model.log[-1] == ("start", "s-warm-drop"))
        model.release()
    assert model.log == [
        ("start", "s-warm-1"),
        ("end", "s-warm-1"),
        ("start", "s-warm-drop"),
        ("end", "s-warm-drop"),
    ]


@pytest.mark.anyio
async def test_nothing_is_warmed_while_the_session_has_nothing_to_warm() -> None:
    model = Model()
    model.turn = None  # a response runs, or no turn is being heard
    async with anyio.create_task_group() as tg:
        warmer = model.warmer(tg)
        warmer.want()
        await settle(lambda: model.asked == 1)
        warmer.discard()  # nothing was warmed: nothing to drop
        model.turn = WarmTurn([], SessionConfig())
        warmer.want()
        await settle(lambda: model.running == 1)
        model.release()
    assert model.log == [("start", "s-warm-1"), ("end", "s-warm-1")]


OPS = st.lists(st.sampled_from(["want", "stop", "discard", "step", "release", "none"]), max_size=30)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_at_most_one_request_runs_and_a_discard_ends_with_a_drop(ops: list[str]) -> None:
    async def run() -> Model:
        model = Model()
        async with anyio.create_task_group() as tg:
            warmer = model.warmer(tg)
            for op in ops:
                if op == "step":
                    await anyio.lowlevel.checkpoint()
                elif op == "release":
                    model.release()
                elif op == "none":
                    model.turn = None if model.turn is not None else WarmTurn([], SessionConfig())
                else:
                    getattr(warmer, op)()
            warmer.discard()
            model.opened = True  # leaving the task group waits for the warmer's last request
            model.release()
        return model

    model = anyio.run(run)
    assert model.most <= 1
    warms = [rid for kind, rid in model.log if kind == "start" and not rid.endswith("drop")]
    if warms:  # whatever was warmed is dropped after the last warm ended
        assert model.log[-2:] == [("start", "s-warm-drop"), ("end", "s-warm-drop")]
        assert model.log.index(("end", warms[-1])) < len(model.log) - 2


@pytest.mark.anyio
async def test_the_server_warms_nothing_while_the_model_is_at_its_bound() -> None:
    started: list[dict[str, Any]] = []

    def generate(**inputs: Any) -> Any:
        started.append(inputs)
        raise AssertionError("no request may start")

    admission = Admission(2)
    tickets = [admission.try_enter() for _ in range(2)]  # the model at its bound
    assert all(tickets)
    served = SimpleNamespace(
        inputs={"messages", "session", "warm"}, admission=admission, runtime=SimpleNamespace()
    )
    served.runtime.generate = generate
    warm = _warmer(served, "sess_1")  # type: ignore[arg-type]
    assert warm is not None
    await warm(WarmTurn([], SessionConfig()), "sess_1-warm-1")
    assert started == []
    no_warm = SimpleNamespace(inputs={"messages", "session"}, admission=admission)
    assert _warmer(no_warm, "sess_1") is None  # type: ignore[arg-type]
