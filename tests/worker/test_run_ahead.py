"""A loop's next step launched before its walk asks for it: where the engine keeps nothing of a
step, or can undo one, the worker starts the next forward first and lets the walk read its
outputs and run ``until`` while that forward runs. The walk's outputs are the same; a step run
ahead of a loop that then stops is dropped (and undone by a KV engine); an engine that can do
neither never sees a step its walk did not ask for; a cancelled walk leaves nothing queued."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import anyio
import pytest
import torch

from mstar_async.engines import Step, StepResult
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.engines.sampling import SamplingParams
from mstar_async.graph import DynamicLoop, Edge, LoopStep, Model, Node, PortRef, Walk
from mstar_async.models.bagel import bagel_config
from mstar_async.models.bagel.mot import BagelLM
from mstar_async.runtime import open_runtime
from mstar_async.worker.walk_loop import WalkLoop

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

STOP_AT = 6  # the loop stops once its counter reaches this


class Ticker:
    """Adds one to ``n``; each forward sleeps ``forward_s`` (2 ms: a forward worth running off
    the loop). ``seen`` lists the counters it was given, ``by_request`` per request."""

    def __init__(self, stateless: bool, forward_s: float = 0.002) -> None:
        self.stateless_steps = stateless
        self.forward_s = forward_s
        self.seen: list[int] = []
        self.by_request: dict[str, list[int]] = {}

    def cost(self, step: Step) -> int:
        return 1

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        if self.forward_s:
            time.sleep(self.forward_s)
        for s in steps:
            self.seen.append(int(s.inputs["n"]))
            self.by_request.setdefault(s.request_id, []).append(int(s.inputs["n"]))
        return [{"n": int(s.inputs["n"]) + 1} for s in steps]

    def release(self, request_id: str) -> None:
        pass

    def export_state(self, request_id: str) -> None:
        return None

    def import_state(self, request_id: str, state: Any) -> None:
        pass


def _stop(step: LoopStep) -> bool:
    return int(step.outputs["tick.n"]) >= STOP_AT


async def _program(request: Any) -> AsyncGenerator[Any, None]:
    yield await request.run("count", n=0)


def counting_model(max_iterations: int = 100, until: Callable[[LoopStep], bool] = _stop) -> Model:
    """One walk, ``count``: a loop of the ``tick`` node, its counter carried, until ``until``."""
    loop = DynamicLoop(
        "tick", until=until, max_iterations=max_iterations, carry={"tick.n": "tick.n"}
    )
    return Model(
        "ticks",
        nodes=[Node("tick", engine="e", inputs=["n"], outputs=["n"])],
        walks=[Walk("count", loop, outputs=["tick.n"])],
        program=_program,
        components={"e": lambda: Ticker(stateless=True)},
    )


class Sink:
    """Records each output and whether a forward was running when the walk made it."""

    def __init__(self, loop: WalkLoop) -> None:
        self.loop = loop
        self.values: list[int] = []
        self.during_forward: list[bool] = []
        self.ended = anyio.Event()
        self.error: BaseException | None = None

    def emit(self, port: str, value: Any, iteration: int) -> None:
        self.values.append(int(value))
        self.during_forward.append(self.loop._in_round)

    def end(self, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        self.error = error
        self.ended.set()


async def until(done: Callable[[], bool]) -> None:
    """Poll ``done`` until it holds (the caller's deadline bounds the wait)."""
    while True:
        if done():
            return
        await anyio.sleep(0.005)


async def run_walk(stateless: bool, *, max_iterations: int = 100) -> tuple[Ticker, Sink]:
    engine = Ticker(stateless)
    loop = WalkLoop({"e": engine}, inline_below_s=0.0)  # every forward on the thread
    sink = Sink(loop)
    plan = counting_model(max_iterations).plan("count")
    async with anyio.create_task_group() as tg:
        await tg.start(loop.run)
        run = loop.start_walk(plan, "r1", {PortRef("tick", "n"): 0}, {}, {}, sink, window=1000)
        with anyio.fail_after(20):
            await sink.ended.wait()
            await until(lambda: not (loop.scheduler.has_work or loop.trampoline.later))
            await until(lambda: not loop._in_round)  # a step launched ahead ends, dropped
        assert run.ended
        tg.cancel_scope.cancel()
    assert loop.walks_running == 0
    return engine, sink


async def test_a_stateless_engine_runs_the_next_step_while_the_walk_reads_this_one() -> None:
    engine, sink = await run_walk(stateless=True)
    assert sink.error is None
    assert sink.values == list(range(1, STOP_AT + 1))
    # Every output was read while the forward of the step after it ran.
    assert all(sink.during_forward), sink.during_forward
    # The loop stopped at 6: the step that would make 7 had been launched and was dropped.
    assert engine.seen == list(range(STOP_AT + 1))


async def test_an_engine_that_keeps_state_only_runs_what_its_walk_asks_for() -> None:
    engine, sink = await run_walk(stateless=False)
    assert sink.error is None
    assert sink.values == list(range(1, STOP_AT + 1))
    assert not any(sink.during_forward)  # outputs are read between forwards
    assert engine.seen == list(range(STOP_AT))


async def test_no_step_is_launched_past_the_loops_last_iteration() -> None:
    engine, sink = await run_walk(stateless=True, max_iterations=3)
    assert sink.values == [1, 2, 3]
    assert engine.seen == [0, 1, 2]


async def test_a_cancelled_walk_leaves_no_step_behind() -> None:
    engine = Ticker(stateless=True)
    loop = WalkLoop({"e": engine}, inline_below_s=0.0)
    sink = Sink(loop)
    plan = counting_model(10**6, until=lambda s: False).plan("count")
    async with anyio.create_task_group() as tg:
        await tg.start(loop.run)
        run = loop.start_walk(plan, "r1", {PortRef("tick", "n"): 0}, {}, {}, sink, window=1000)
        with anyio.fail_after(20):
            await until(lambda: len(sink.values) >= 20)
            run.cancel()
            loop.kick()
            await until(lambda: not (loop.scheduler.has_work or loop._in_round))
        tg.cancel_scope.cancel()
    assert sink.ended.is_set() and sink.error is None
    assert loop.walks_running == 0
    assert not loop.trampoline.later and not loop.trampoline.ready
    # At most the step in flight when the cancel came ran after the last output read.
    assert len(engine.seen) <= len(sink.values) + 2


def tiny_kv_engine() -> KVCacheEngine:
    torch.manual_seed(0)
    lm = BagelLM(bagel_config("tiny"))
    return KVCacheEngine(
        lm, lm.language_model.attention_spec(), num_layers=2, num_blocks=64, block_size=4
    )


class Undiscardable:
    """The same KV engine without ``discard``: its decode steps never run ahead."""

    def __init__(self) -> None:
        self.inner = tiny_kv_engine()

    @property
    def blocks_in_use(self) -> int:
        return self.inner.blocks_in_use

    def cost(self, step: Step) -> int:
        return self.inner.cost(step)

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        assert not any(step.ahead for step in steps)
        return self.inner.forward(steps)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def export_state(self, request_id: str) -> Any:
        return self.inner.export_state(request_id)

    def import_state(self, request_id: str, state: Any) -> None:
        self.inner.import_state(request_id, state)


TURNS = ([5, 9, 2, 7], [11, 3])  # the second turn's prompt extends the first turn's sequence


async def _two_turns(request: Any, temperature: float = 1.0) -> AsyncGenerator[Any, None]:
    sampling = SamplingParams(temperature=temperature, seed=7, max_tokens=100)
    for turn, tokens in enumerate(TURNS):
        first = await request.run("prefill", tokens=tokens, sampling=sampling)
        yield (turn, int(first["token"]))
        async with request.stream("decode", params={"n": 4 + turn}) as events:
            async for event in events:
                yield (turn, int(event.value))


def two_turn_lm(engine: Callable[[], Any]) -> Model:
    decode = DynamicLoop(
        "decode",
        until=lambda s: s.iteration + 1 >= s.params["n"],
        max_iterations=64,
        carry={"decode.token": "decode.token"},
    )
    return Model(
        "two-turns",
        nodes=[
            Node("prefill", engine="lm", inputs=["tokens", "sampling"], outputs=["token"]),
            Node("decode", engine="lm", inputs=["token"], outputs=["token"]),
        ],
        edges=[Edge("prefill.token", "decode.token")],
        walks=[
            Walk("prefill", "prefill", outputs=["prefill.token"]),
            Walk("decode", decode, outputs=["decode.token"]),
        ],
        program=_two_turns,
        components={"lm": engine},
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
async def test_a_kv_decode_run_ahead_and_dropped_is_undone(temperature: float) -> None:
    # Each turn's loop stops with a decode step launched ahead; the engine undoes it (its
    # token's KV and its sampler's draw), so the next turn continues the very same sequence.
    answers = []
    for factory in (Undiscardable, tiny_kv_engine):
        async with open_runtime(two_turn_lm(factory)) as runtime:
            runtime.batching.inline_below_s = 0.0  # every forward on the thread: overlap
            with anyio.fail_after(30):
                async with runtime.generate(temperature=temperature) as outputs:
                    answers.append([item async for item in outputs])
            assert runtime.batching.kv_blocks_in_use == 0
            if isinstance(runtime.batching.engines["lm"], KVCacheEngine):
                assert runtime.batching.stats.steps > len(answers[-1])  # some ran ahead
    assert [turn for turn, _ in answers[0]] == [0] * 5 + [1] * 6
    assert answers[1] == answers[0]
