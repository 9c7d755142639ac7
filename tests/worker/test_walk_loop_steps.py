"""Single steps through a worker's batching loop (`WalkLoop.submit`, as walks that span ranks
send them): token budgets, chunked steps, cancellation, errors, release."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from mstar_async.engines import WAIT, Step, StepResult
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.errors import EngineError, KVCacheFull, RequestCancelled
from mstar_async.models.bagel import bagel_config
from mstar_async.models.bagel.mot import BagelLM
from mstar_async.transport import StepCall
from mstar_async.worker.walk_loop import WalkLoop

pytestmark = pytest.mark.anyio


class CountingEngine:
    """Each step needs ``inputs["n"]`` tokens; a forward processes at most the step's budget."""

    def __init__(self) -> None:
        self.done: dict[str, int] = {}
        self.forwards: list[list[tuple[str, int]]] = []
        self.released: list[str] = []

    def cost(self, step: Step) -> int:
        return int(step.inputs["n"]) - self.done.get(step.request_id, 0)

    def forward(self, steps: Sequence[Step]) -> list[dict[str, Any] | None]:
        self.forwards.append([(s.request_id, s.budget) for s in steps])
        results: list[dict[str, Any] | None] = []
        for step in steps:
            if step.inputs.get("fail"):
                raise ValueError("boom")
            self.done[step.request_id] = self.done.get(step.request_id, 0) + step.budget
            finished = self.done[step.request_id] >= int(step.inputs["n"])
            results.append({"tokens": self.done[step.request_id]} if finished else None)
        return results

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
        self.done.pop(request_id, None)


def call(request_id: str, n: int, **extra: Any) -> StepCall:
    return StepCall(request_id, "lm", "step", {"n": n, **extra})


async def run_calls(loop: WalkLoop, calls: list[StepCall]) -> dict[str, Any]:
    results: dict[str, Any] = {}

    async def one(c: StepCall) -> None:
        try:
            results[c.request_id] = await loop.submit(c)
        except EngineError as exc:
            results[c.request_id] = exc

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run)
            async with anyio.create_task_group() as calls_tg:
                for c in calls:
                    calls_tg.start_soon(one, c)
            tg.cancel_scope.cancel()
    return results


async def test_long_steps_are_chunked_and_short_steps_go_first() -> None:
    engine = CountingEngine()
    loop = WalkLoop({"lm": engine}, max_batch_tokens=8)
    calls = [call("prompt", 20), call("d1", 1), call("d2", 1), call("d3", 1)]
    results = await run_calls(loop, calls)
    assert results == {
        "prompt": {"tokens": 20},
        "d1": {"tokens": 1},
        "d2": {"tokens": 1},
        "d3": {"tokens": 1},
    }
    # First forward: the three one-token steps, then the prompt with what is left of 8.
    assert engine.forwards[0] == [("d1", 1), ("d2", 1), ("d3", 1), ("prompt", 5)]
    assert engine.forwards[1:] == [[("prompt", 8)], [("prompt", 7)]]
    assert all(sum(b for _, b in f) <= 8 for f in engine.forwards)


async def test_batch_size_cap() -> None:
    engine = CountingEngine()
    loop = WalkLoop({"lm": engine}, max_batch_size=3)
    await run_calls(loop, [call(f"r{i}", 1) for i in range(7)])
    assert [len(f) for f in engine.forwards] == [3, 3, 1]
    assert loop.stats.max_batch == 3 and loop.stats.steps == 7


async def test_a_failing_forward_fails_its_steps_with_an_engine_error() -> None:
    engine = CountingEngine()
    loop = WalkLoop({"lm": engine})
    results = await run_calls(loop, [call("bad", 1, fail=True), call("good", 1)])
    assert isinstance(results["bad"], EngineError)
    assert str(results["bad"]) == "engine 'lm' failed: ValueError('boom')"
    assert isinstance(results["bad"].__cause__, ValueError)
    assert isinstance(results["good"], EngineError)  # the whole forward failed


async def test_unknown_engine_is_refused() -> None:
    loop = WalkLoop({"lm": CountingEngine()})
    with pytest.raises(EngineError, match="no engine 'tts' on this worker"):
        await loop.submit(StepCall("r", "tts", "op", {}))


async def test_cancelled_queued_step_leaves_the_queue() -> None:
    engine = CountingEngine()
    loop = WalkLoop({"lm": engine})
    with anyio.fail_after(10):
        with anyio.CancelScope() as scope:
            scope.cancel()
            await loop.submit(call("gone", 1))  # never taken: no loop is running
    assert not loop.scheduler.has_work
    assert engine.forwards == []


async def test_releasing_a_request_fails_its_queued_step_without_cancelling_its_caller() -> None:
    # A released request's queued step must end its caller with an error: a cancelled future
    # would cancel the worker task awaiting it, and with it the task group serving the worker.
    loop = WalkLoop({"lm": CountingEngine()})
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            outcome: list[BaseException] = []

            async def caller() -> None:
                try:
                    await loop.submit(call("gone", 1))
                except RequestCancelled as exc:
                    outcome.append(exc)

            tg.start_soon(caller)
            await anyio.wait_all_tasks_blocked()
            await loop.release("gone")  # no loop runs: the step is still queued
            await anyio.wait_all_tasks_blocked()
        assert not tg.cancel_scope.cancel_called
    assert len(outcome) == 1 and "released" in str(outcome[0])


async def test_release_reaches_every_engine() -> None:
    a, b = CountingEngine(), CountingEngine()
    loop = WalkLoop({"a": a, "b": b})
    await loop.release("r1")
    assert a.released == ["r1"] and b.released == ["r1"]


class WaitingEngine(CountingEngine):
    """Never has memory for anything."""

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:  # type: ignore[override]
        return [WAIT for _ in steps]


@pytest.mark.timeout(30)
async def test_a_step_no_release_could_serve_fails_instead_of_hanging() -> None:
    loop = WalkLoop({"lm": WaitingEngine()})
    results = await run_calls(loop, [call("alone", 1)])
    assert isinstance(results["alone"], KVCacheFull)
    assert loop.scheduler.parked == []


def _bagel_engine(num_blocks: int) -> KVCacheEngine:
    lm = BagelLM(bagel_config("tiny"))
    return KVCacheEngine(
        lm, lm.language_model.attention_spec(), num_layers=2, num_blocks=num_blocks
    )


def _attend(request_id: str) -> StepCall:
    latent = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    inputs = {"seq": "a", "latent": latent, "t": torch.tensor(0.5)}
    return StepCall(request_id, "lm", "attend", inputs)


def _prefill(request_id: str) -> StepCall:
    return StepCall(request_id, "lm", "prefill", {"tokens": list(range(20))})


@pytest.mark.timeout(60)
async def test_an_attend_that_never_fits_beside_its_own_prefix_fails_within_a_deadline() -> None:
    engine = _bagel_engine(num_blocks=3)
    loop = WalkLoop({"lm": engine})
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run)
            await loop.submit(_prefill("r"))
            await loop.submit(StepCall("r", "lm", "fork", {"seq": "a"}))
            with pytest.raises(KVCacheFull) as caught:
                await loop.submit(_attend("r"))
            assert "attend needs 2 more blocks for 16 tokens" in str(caught.value)
            assert "only 1 of the cache's 3 blocks" in str(caught.value)
            assert loop.scheduler.parked == []
            await loop.release("r")
            tg.cancel_scope.cancel()
    assert engine.blocks_in_use == 0


@pytest.mark.timeout(60)
async def test_an_attend_parks_while_another_request_holds_memory_and_runs_after() -> None:
    engine = _bagel_engine(num_blocks=4)
    loop = WalkLoop({"lm": engine})
    outputs: list[dict[str, Any]] = []
    finished = anyio.Event()

    async def attend() -> None:
        outputs.append(await loop.submit(_attend("r")))
        finished.set()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run)
            await loop.submit(_prefill("r"))
            await loop.submit(_prefill("q"))
            await loop.submit(StepCall("r", "lm", "fork", {"seq": "a"}))
            tg.start_soon(attend)
            while not loop.scheduler.parked:  # the attend ran, got WAIT and was parked
                await anyio.lowlevel.checkpoint()
            assert outputs == [] and engine.blocks_in_use == 4
            await loop.release("q")
            await finished.wait()
            tg.cancel_scope.cancel()
    assert "velocity" in outputs[0] and engine.blocks_in_use == 2
