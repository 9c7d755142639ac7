"""A module whose import alone leaves a mark: it touches the file ``MSTAR_TEST_CANARY`` names.
Tests that make a worker refuse a model source check that nothing imported it."""

from __future__ import annotations

import os
from pathlib import Path

from mstar_async.graph import Model
from mstar_async.models import build_model

if "MSTAR_TEST_CANARY" in os.environ:
    Path(os.environ["MSTAR_TEST_CANARY"]).touch()


def build() -> Model:
    """The demo model (what the builder returns matters to no test)."""
    return build_model("demo")
