"""The model sources a joining worker agrees to build, checked without importing anything."""

from __future__ import annotations

from typing import Any

import pytest

from mstar_async.errors import SourceRefused
from mstar_async.graph import ModelSource
from mstar_async.worker.sources import ZOO_BUILDER, AllowedSources

CANARY = "tests.worker.import_canary:build"


def zoo(name: Any, **options: Any) -> dict[str, Any]:
    return {"target": ZOO_BUILDER, "options": {"name": name, **options}}


def test_any_zoo_model_with_plain_options_by_default() -> None:
    source = zoo("causal-lm", path="/models/llama", size="tiny", layers=[1, 2], cfg={"a": None})
    assert AllowedSources().check(source) == ModelSource(ZOO_BUILDER, source["options"])


def test_only_the_named_zoo_models_when_some_are_named() -> None:
    allowed = AllowedSources(models=frozenset({"demo"}))
    assert allowed.check(zoo("demo")).options == {"name": "demo"}
    with pytest.raises(SourceRefused) as refused:
        allowed.check(zoo("orpheus"))
    assert str(refused.value) == (
        "the runtime asked this worker to build the zoo model 'orpheus'; it builds the zoo "
        "models ['demo']. To allow that model, start the worker with --model orpheus"
    )


@pytest.mark.parametrize("target", ["subprocess:getoutput", "os:system", CANARY])
def test_a_builder_the_worker_was_not_started_with_is_refused(target: str) -> None:
    with pytest.raises(SourceRefused) as refused:
        AllowedSources().check({"target": target, "options": {"cmd": "id"}})
    assert str(refused.value) == (
        f"the runtime asked this worker to build {target!r}, which it was not started to "
        f"build; it builds any zoo model. If that builder is yours, start the worker with "
        f"--source {target}"
    )


def test_a_builder_named_on_the_command_line_is_built() -> None:
    allowed = AllowedSources(builders=frozenset({CANARY}))
    assert allowed.check({"target": CANARY}) == ModelSource(CANARY)
    assert "and the builders ['tests.worker.import_canary:build']" in allowed.describe()


@pytest.mark.parametrize(
    "source",
    [
        None,
        "mstar_async.models:build_model",
        {"target": ZOO_BUILDER, "options": {"name": "demo"}, "extra": 1},
        {"target": 3},
        {"target": ZOO_BUILDER, "options": ["demo"]},
        {"target": ZOO_BUILDER, "options": {}},
        zoo("demo", size=object()),
        zoo("demo", cfg={1: "a"}),
        zoo("demo", sizes=(1, 2)),
    ],
)
def test_malformed_sources_and_options_that_are_not_plain_data_are_refused(source: Any) -> None:
    with pytest.raises(SourceRefused, match="malformed|not plain data|without a name"):
        AllowedSources().check(source)
