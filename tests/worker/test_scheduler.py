"""The scheduler core, driven synchronously: budgets, requeue, park and wake, cancel, state
moves through the engine protocol, and forwards kept within a time bound."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mstar_async.engines import WAIT, Step, StepResult
from mstar_async.errors import EngineError, KVCacheFull
from mstar_async.transport import DROP_OP, EXPORT_OP, IMPORT_OP
from mstar_async.worker import Job, Scheduler
from mstar_async.worker.scheduler import ForwardTimer

pytestmark = pytest.mark.timeout(30)


class Clock:
    """A fake clock the fake engine advances: no real time passes in these tests."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Fake:
    """Each step needs ``inputs["n"]`` tokens; a forward computes its budget's worth of them.

    A forward takes ``fixed + per_token * tokens`` on ``clock``. Requests in ``blocked`` get
    ``WAIT``; ``held`` is what ``export_state`` gives and ``import_state`` takes.
    """

    def __init__(self, clock: Clock | None = None, per_token: float = 0.0, fixed: float = 0.0):
        self.clock = clock
        self.per_token = per_token
        self.fixed = fixed
        self.done: dict[str, int] = {}
        self.forwards: list[list[tuple[str, int]]] = []
        self.blocked: set[str] = set()
        self.released: list[str] = []
        self.held: dict[str, Any] = {}
        self.full: set[str] = set()  # requests whose import finds no room

    def cost(self, step: Step) -> int:
        if step.inputs.get("bad_cost"):
            raise ValueError("no cost")
        return int(step.inputs.get("n", 1)) - self.done.get(step.request_id, 0)

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        self.forwards.append([(s.request_id, s.budget) for s in steps])
        if self.clock is not None:
            self.clock.now += self.fixed + self.per_token * sum(s.budget for s in steps)
        results: list[StepResult] = []
        for step in steps:
            if step.request_id in self.blocked:
                results.append(WAIT)
                continue
            if step.inputs.get("fail"):
                results.append(ValueError("step failed"))
                continue
            grant = int(step.inputs["n"]) if step.inputs.get("whole") else step.budget
            done = self.done[step.request_id] = self.done.get(step.request_id, 0) + grant
            finished = done >= int(step.inputs.get("n", 1))
            if finished:
                del self.done[step.request_id]
            results.append({"tokens": done} if finished else None)
        return results

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
        self.done.pop(request_id, None)

    def export_state(self, request_id: str) -> Any:
        return self.held.get(request_id)

    def import_state(self, request_id: str, state: Any) -> None:
        if request_id in self.full:
            raise KVCacheFull("no room")
        if state is not None:
            self.held[request_id] = state


def job(request_id: str, n: int = 1, engine: str = "lm", op: str = "step", **inputs: Any) -> Job:
    return Job(engine, Step(request_id, op, {"n": n, **inputs}), owner=request_id)


def drain(scheduler: Scheduler, rounds: int = 100) -> dict[str, Any]:
    outcomes: dict[str, Any] = {}
    for _ in range(rounds):
        if not scheduler.has_work:
            return outcomes
        for done, outcome in scheduler.run_round():
            outcomes[done.owner] = outcome
    raise AssertionError(f"still working after {rounds} rounds")


def test_one_token_steps_go_first_and_long_ones_are_chunked_within_the_budget() -> None:
    engine = Fake()
    scheduler = Scheduler({"lm": engine}, max_batch_tokens=8)
    for j in [job("prompt", 20), job("d1"), job("d2"), job("d3")]:
        scheduler.submit(j)
    outcomes = drain(scheduler)
    assert outcomes["prompt"] == {"tokens": 20} and outcomes["d1"] == {"tokens": 1}
    assert engine.forwards == [
        [("d1", 1), ("d2", 1), ("d3", 1), ("prompt", 5)],
        [("prompt", 8)],
        [("prompt", 7)],
    ]
    assert scheduler.stats.forwards == 3 and scheduler.stats.steps == 6


def test_the_batch_size_caps_each_forward() -> None:
    engine = Fake()
    scheduler = Scheduler({"lm": engine}, max_batch_size=3)
    for i in range(7):
        scheduler.submit(job(f"r{i}"))
    drain(scheduler)
    assert [len(f) for f in engine.forwards] == [3, 3, 1]
    assert scheduler.stats.max_batch == 3


def test_an_unfinished_step_goes_back_to_the_front_of_the_queue() -> None:
    engine = Fake()
    scheduler = Scheduler({"lm": engine}, max_batch_tokens=4, max_batch_size=2)
    first, later = job("first", 6), job("later", 3)
    scheduler.submit(first)
    assert scheduler.run_round() == []  # 4 of 6 tokens computed: None, requeued
    scheduler.submit(later)
    chosen = scheduler.take()
    # The requeued step stays ahead of the newer one and gets what it still needs.
    assert [(j.owner, j.step.budget) for j in chosen.jobs] == [("first", 2), ("later", 2)]
    scheduler.forward(chosen)
    assert [(j.owner, o) for j, o in scheduler.finish(chosen)] == [("first", {"tokens": 6})]


def test_waiting_steps_park_until_a_release_and_then_run() -> None:
    engine = Fake()
    scheduler = Scheduler({"lm": engine})
    holder = job("holder")
    assert scheduler.submit(holder) is None and drain(scheduler) == {"holder": {"tokens": 1}}
    engine.blocked.add("waiter")
    scheduler.submit(job("waiter"))
    assert scheduler.run_round() == []
    # The holder ran here and was not released: it may free memory, so the waiter parks.
    assert not scheduler.has_work and [j.owner for j in scheduler.parked] == ["waiter"]
    engine.blocked.clear()
    scheduler.release("holder")
    assert engine.released == ["holder"] and scheduler.has_work
    assert drain(scheduler) == {"waiter": {"tokens": 1}}


def test_a_wait_beside_progress_is_retried_not_parked() -> None:
    engine = Fake()
    scheduler = Scheduler({"lm": engine})
    engine.blocked.add("w")
    scheduler.submit(job("w"))
    scheduler.submit(job("ok"))
    assert [j.owner for j, _ in scheduler.run_round()] == ["ok"]
    assert scheduler.has_work and scheduler.parked == []


def test_a_step_that_waits_with_no_one_to_free_memory_fails_instead_of_parking() -> None:
    engine = Fake()
    scheduler = Scheduler({"lm": engine})
    engine.blocked.add("alone")
    scheduler.submit(job("alone"))
    [(failed, error)] = scheduler.run_round()
    assert failed.owner == "alone" and isinstance(error, KVCacheFull)
    assert "waits for memory that no other request holds" in str(error)
    assert scheduler.parked == [] and not scheduler.has_work


def test_when_every_holder_waits_the_newest_fails_and_the_others_park() -> None:
    engine = Fake()
    scheduler = Scheduler({"lm": engine})
    for rid in ("a", "b"):
        scheduler.submit(job(rid))
    drain(scheduler)  # both now hold memory
    engine.blocked |= {"a", "b"}
    scheduler.submit(job("a"))
    scheduler.submit(job("b"))
    [(failed, error)] = scheduler.run_round()
    assert failed.owner == "b" and isinstance(error, KVCacheFull)
    # b still holds memory until it is released, so a parks rather than failing too.
    assert scheduler.run_round() == [] and [j.owner for j in scheduler.parked] == ["a"]
    engine.blocked.clear()
    scheduler.release("b")
    assert drain(scheduler) == {"a": {"tokens": 1}}


def test_cancel_removes_queued_and_parked_jobs_and_drops_those_in_flight() -> None:
    engine = Fake()
    scheduler = Scheduler({"lm": engine})
    scheduler.submit(job("holder"))
    drain(scheduler)
    engine.blocked.add("r")
    parked = job("r")
    scheduler.submit(parked)
    scheduler.run_round()
    assert scheduler.parked == [parked]
    queued, other = job("r", 5), job("s")
    scheduler.submit(queued)
    scheduler.submit(other)
    assert scheduler.cancel("r") == [queued, parked]
    assert scheduler.parked == [] and scheduler.queued == 1
    # A job in a forward when its request is cancelled: its outcome is dropped.
    engine.blocked.clear()
    flying = job("t", 3)
    scheduler.submit(flying)
    chosen = scheduler.take()
    assert scheduler.cancel("t") == []
    scheduler.forward(chosen)
    assert [j.owner for j, _ in scheduler.finish(chosen)] == ["s"]
    assert not scheduler.has_work


def test_withdraw_takes_back_one_job() -> None:
    scheduler = Scheduler({"lm": Fake()})
    mine, theirs = job("r"), job("r")
    scheduler.submit(mine)
    scheduler.submit(theirs)
    assert scheduler.withdraw(mine) is True and scheduler.withdraw(mine) is False
    assert drain(scheduler) == {"r": {"tokens": 1}} and scheduler.stats.steps == 1


def test_an_unknown_engine_is_refused_naming_the_engines() -> None:
    scheduler = Scheduler({"lm": Fake(), "codec": Fake()})
    with pytest.raises(EngineError, match=r"no engine 'tts' on this worker; engines: \['codec'"):
        scheduler.submit(job("r", engine="tts"))


def test_errors_fail_their_steps_and_a_raising_cost_counts_one() -> None:
    scheduler = Scheduler({"lm": Fake()})
    scheduler.submit(job("bad", fail=True))
    scheduler.submit(job("odd", 1, bad_cost=True))
    outcomes = drain(scheduler)
    assert isinstance(outcomes["bad"], EngineError)
    assert str(outcomes["bad"]) == "engine 'lm' failed: ValueError('step failed')"
    assert isinstance(outcomes["bad"].__cause__, ValueError)
    assert outcomes["odd"] == {"tokens": 1}


def test_state_moves_through_the_engine_protocol_without_a_forward() -> None:
    source, target = Fake(), Fake()
    scheduler = Scheduler({"a": source, "b": target})
    source.held["r"] = {"kv": 42}
    scheduler.submit(Job("a", Step("r", EXPORT_OP, {}), owner="export"))
    exported = drain(scheduler)["export"]
    assert exported == {"state": {"kv": 42}} and source.held == {"r": {"kv": 42}}
    scheduler.submit(Job("b", Step("r", IMPORT_OP, exported), owner="import"))
    assert drain(scheduler)["import"] == {} and target.held == {"r": {"kv": 42}}
    scheduler.submit(Job("a", Step("r", DROP_OP, {}), owner="drop"))
    assert drain(scheduler)["drop"] == {} and source.released == ["r"]
    assert scheduler.stats.forwards == 0  # moves are not forwards


def test_an_import_without_room_waits_for_a_release_and_then_lands() -> None:
    target = Fake()
    scheduler = Scheduler({"b": target})
    scheduler.submit(job("holder", engine="b"))  # a request that holds memory in the engine
    scheduler.run_round()
    target.full.add("r")
    scheduler.submit(Job("b", Step("r", IMPORT_OP, {"state": 7}), owner="import"))
    assert scheduler.run_round() == [] and scheduler.parked  # no room: parked, not failed
    target.full.clear()
    scheduler.release("holder")
    assert drain(scheduler)["import"] == {} and target.held == {"r": 7}


def test_an_engine_without_the_state_protocol_moves_nothing() -> None:
    class Plain:
        def cost(self, step: Step) -> int:
            return 1

        def forward(self, steps: Sequence[Step]) -> list[StepResult]:
            return [{} for _ in steps]

        def release(self, request_id: str) -> None:
            pass

    scheduler = Scheduler({"e": Plain()})
    scheduler.submit(Job("e", Step("r", EXPORT_OP, {}), owner="export"))
    scheduler.submit(Job("e", Step("r", IMPORT_OP, {"state": None}), owner="none"))
    scheduler.submit(Job("e", Step("q", IMPORT_OP, {"state": 1}), owner="some"))
    outcomes = drain(scheduler)
    assert outcomes["export"] == {"state": None} and outcomes["none"] == {}
    assert isinstance(outcomes["some"], EngineError)


def test_long_prefills_shrink_into_chunks_whose_forward_stays_within_the_bound() -> None:
    clock = Clock()
    engine = Fake(clock, per_token=0.001)  # 1 ms per token: 100 tokens fill the 0.1 s bound
    scheduler = Scheduler({"lm": engine}, max_batch_tokens=512, clock=clock)
    scheduler.submit(job("prompt", 2000))
    scheduler.submit(job("decode"))
    drain(scheduler)
    budgets = [sum(b for _, b in f) for f in engine.forwards]
    assert budgets[0] == 512  # nothing measured yet
    assert all(b <= 100 for b in budgets[1:]) and budgets[1] >= 99
    assert sum(budgets) == 2001


def test_the_bound_never_drops_decodes_or_a_prefill_below_one_token() -> None:
    clock = Clock()
    engine = Fake(clock, per_token=0.05)  # 2 tokens fill the bound
    scheduler = Scheduler({"lm": engine}, clock=clock)
    scheduler.submit(job("warm", 4))
    drain(scheduler)
    for i in range(5):
        scheduler.submit(job(f"d{i}"))
    scheduler.submit(job("prompt", 10))
    chosen = scheduler.take()
    budgets = [j.step.budget for j in chosen.jobs]
    # Every decode, and the prompt's chunk on top: what 0.1 s buys (no decode round is known
    # yet to take its share), and never nothing.
    assert budgets[:5] == [1] * 5 and 1 <= budgets[5] <= 2


def test_steps_an_engine_runs_whole_are_not_split_up_by_the_bound() -> None:
    clock = Clock()
    engine = Fake(clock, per_token=0.01)  # 10 tokens fill the bound
    scheduler = Scheduler({"lm": engine}, clock=clock)
    scheduler.submit(job("warm", 20))
    drain(scheduler)
    # Three 16-token steps of an op the engine runs whole (each finishes on any budget).
    for i in range(3):
        scheduler.submit(job(f"b{i}", 16, op="attend", whole=True))
    first = scheduler.take()
    assert [(j.owner, j.step.budget) for j in first.jobs] == [("b0", 10)]
    scheduler.forward(first)
    scheduler.finish(first)  # b0 finished on 10 of its 16 tokens: attend runs whole
    chosen = scheduler.take()
    assert [(j.owner, j.step.budget) for j in chosen.jobs] == [("b1", 16), ("b2", 16)]


def test_a_fixed_forward_cost_is_not_charged_to_the_tokens() -> None:
    timer = ForwardTimer()
    for tokens in (50, 300, 100, 512):
        timer.observe(0, tokens, 0.05 + 0.0001 * tokens)
    estimate = timer.estimate()
    assert estimate is not None
    assert estimate[0] == pytest.approx(0.05) and estimate[1] == pytest.approx(0.0001)
    assert timer.tokens_within(0.1) == pytest.approx(500, abs=1)
    # A fixed cost over the bound by itself: smaller chunks cannot help, so chunks grow (by
    # half each time) towards costing as much again as the fixed cost: 0.2 s at 0.1 ms.
    slow = ForwardTimer()
    for tokens in (10, 20):
        slow.observe(0, tokens, 0.2 + 0.0001 * tokens)
    assert slow.tokens_within(0.1) == 30
    for tokens in (1000, 1500):
        slow.observe(0, tokens, 0.2 + 0.0001 * tokens)
    assert slow.tokens_within(0.1) == pytest.approx(2000, abs=2)


def test_decode_rounds_near_the_bound_still_leave_prompts_a_share_of_the_forward() -> None:
    timer = ForwardTimer()
    for tokens in (100, 300):
        timer.observe(0, tokens, 0.01 + 0.001 * tokens)  # 1 ms per prompt token
    timer.observe(32, 0, 0.09)  # a decode round alone takes 90 ms of the 100 ms bound
    # Beside decodes a forward may take a decode round and a quarter: 22.5 ms of prompt tokens
    # (until a forward beside decodes is seen, the prompt-only forwards' fixed 10 ms counts as
    # part of what a decode round costs).
    assert timer.time_limit(0.1, decoding=True) == pytest.approx(0.1125)
    assert timer.tokens_within(0.1, decoding=True) == pytest.approx(22, abs=1)
    # What a forward with decodes takes over a decode round teaches the per-token cost.
    timer.observe(32, 50, 0.09 + 0.001 * 50)
    estimate = timer.estimate(decoding=True)
    assert estimate is not None and estimate[1] == pytest.approx(0.001, rel=0.05)
    fast = ForwardTimer()
    fast.observe(0, 200, 0.002 + 0.0001 * 200)
    fast.observe(0, 50, 0.002 + 0.0001 * 50)
    fast.observe(32, 0, 0.01)  # fast decodes: a forward beside them takes 1.5 at most
    assert fast.time_limit(0.1, decoding=True) == pytest.approx(0.015)
    assert fast.time_limit(0.1, decoding=False) == pytest.approx(0.1)
    # 50 tokens fit the 5 ms left beside the decodes (the last chunk was 50: it may grow to 75).
    assert fast.tokens_within(0.1, decoding=True) == 50


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        Scheduler({}, max_batch_size=0)
    with pytest.raises(ValueError, match="forward_time_bound_s"):
        Scheduler({}, forward_time_bound_s=0)


@settings(max_examples=60, deadline=None)
@example(fixed=0.001649176934981445, per_token=0.0005711806045772628, decoders=7, prompt=200)
@given(
    fixed=st.floats(0.0, 0.05),
    per_token=st.floats(1e-5, 2e-3),
    decoders=st.integers(1, 32),
    prompt=st.integers(200, 3000),
)
def test_a_long_prompt_beside_decodes_keeps_each_forward_within_three_decode_rounds(
    fixed: float, per_token: float, decoders: int, prompt: int
) -> None:
    clock = Clock()
    engine = Fake(clock, per_token=per_token, fixed=fixed)
    scheduler = Scheduler({"lm": engine}, max_batch_tokens=4096, clock=clock)
    # The engine has seen prompts of two sizes and decode rounds before this one arrives.
    for warm in (64, 512):
        scheduler.submit(job(f"w{warm}", warm))
        drain(scheduler)
    for i in range(decoders):
        scheduler.submit(job(f"d{i}"))
    drain(scheduler)
    decode_round = fixed + per_token * decoders
    scheduler.submit(job("prompt", prompt))
    rounds = 0
    while scheduler.has_work:
        for i in range(decoders):
            scheduler.submit(job(f"d{i}"))
        before = clock.now
        scheduler.run_round()
        took = clock.now - before
        rounds += 1
        # A running request waits about three decode rounds at most for its next token (10%
        # for what the timer's estimates miss while they settle).
        assert took <= 3 * decode_round * 1.1 + 1e-9, (rounds, took, decode_round)
        assert rounds <= prompt + 50, "the prompt made no progress"  # a token a round at least


def test_chunks_slowed_by_a_fixed_cost_grow_to_what_the_fixed_cost_buys() -> None:
    # A small model on a CPU: a decode round takes 1.8 ms, and putting any prompt chunk beside
    # it adds ~5 ms, plus 0.01 ms a token. One-token chunks would go on forever and never teach
    # the timer a slope: it tries two, learns the fixed cost, and grows the chunks by half
    # to what that cost buys again (smaller chunks could not keep within the limit anyway).
    timer = ForwardTimer()
    timer.observe(1, 0, 0.0018)
    for _ in range(20):
        timer.observe(1, 1, 0.0018 + 0.005 + 0.00001)
    grants = [timer.tokens_within(0.1, decoding=True)]
    assert grants == [2]
    for _ in range(20):
        chunk = grants[-1]
        assert chunk is not None
        timer.observe(1, chunk, 0.0018 + 0.005 + 0.00001 * chunk)
        grants.append(timer.tokens_within(0.1, decoding=True))
    assert grants[:5] == [2, 3, 5, 8, 12]  # never more than half as large again as the last
    assert grants[-1] == pytest.approx(500, rel=0.05)
    # Chunks of one size that fit exactly keep that size rather than shrink by rounding.
    steady = ForwardTimer()
    steady.observe(1, 0, 0.004)  # a decode round and a half leave 2 ms beside the decodes
    for _ in range(20):
        steady.observe(1, 8, 0.004 + 8 * 0.00025)  # 2 ms of chunk
    assert steady.tokens_within(0.1, decoding=True) == 8
