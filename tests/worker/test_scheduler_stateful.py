"""Hypothesis drives the scheduler, synchronously, over a real ``KVCacheEngine`` with a tiny
seeded model and a pool of 8 blocks of 4 tokens: requests prefill (some longer than the whole
pool), decode, fork, attend and extend on branches, and are cancelled and released at any time.
They also keep KV beyond themselves: ``retain`` a session, ``attach`` to one, fork a named
``prefix`` (computed on a miss, evicted least recently used), and handles are dropped at any
time between rounds.

After every rule: no block leaks (free + used == total, every held block belongs to a live
request). After every drain (rounds until no job is runnable, at most ``ROUNDS``): each job has
completed, failed with ``KVCacheFull`` or is parked; a parked job truly does not fit now, and
someone a release could free holds memory, and no prefix handle is left that evicting could
free; a job that could never fit has failed with ``KVCacheFull`` rather than wait. At teardown,
after every request is released and every handle dropped, every block is free. Like a
conductor, the machine releases a request whose step failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mstar_async.engines import Step
from mstar_async.engines.kv import AttentionSpec
from mstar_async.engines.kv_engine import HandleKey, KVCacheEngine, _key
from mstar_async.errors import EngineError, KVCacheFull
from mstar_async.worker import Job, Scheduler

BLOCKS, BLOCK_SIZE, VOCAB = 8, 4, 50
# Named prefixes of 6 and 13 tokens (2 and 4 blocks) and one of 40 (10 blocks: never fits).
PREFIXES = {"p0": 6, "p1": 13, "p2": 40}
ROUNDS = 200
SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


class Toy(torch.nn.Module):
    """One attention layer whose K/V come straight from an embedding; it runs query ops too."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 4 * 8)

    def _attend(self, x: torch.Tensor, attention: Any) -> torch.Tensor:
        n = x.shape[0]
        q = x.view(n, 4, 8)
        out: torch.Tensor = attention(0, q, q[:, :2].contiguous(), q[:, 2:].contiguous())
        return out.reshape(n, -1)

    def forward(self, input_ids: torch.Tensor, attention: Any) -> torch.Tensor:
        return self._attend(self.embed(input_ids), attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, :VOCAB]

    def query_length(self, inputs: Mapping[str, Any]) -> int:
        return int(inputs["x"].shape[0])

    def forward_queries(
        self, op: str, inputs: Sequence[Mapping[str, Any]], attention: Any
    ) -> list[dict[str, Any]]:
        lengths = [self.query_length(i) for i in inputs]
        out = self._attend(torch.cat([i["x"] for i in inputs]), attention)
        return [{"y": y} for y in out.split(lengths)]


@dataclass
class Request:
    rid: str
    token: int | None = None  # the last sampled token: set once its first prefill finished
    branches: list[str] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)  # outstanding

    @property
    def idle(self) -> bool:
        return not self.jobs


@dataclass
class Expect:
    request: Request
    never_fits: bool


class SchedulerMachine(RuleBasedStateMachine):
    """Rules submit, run, cancel and release; invariants and drains check the rules above."""

    @initialize()
    def start(self) -> None:
        torch.manual_seed(0)
        self.engine = KVCacheEngine(
            Toy(), SPEC, num_layers=1, num_blocks=BLOCKS, block_size=BLOCK_SIZE
        )
        self.alloc = self.engine.allocator
        # A clock that never moves: forwards look free, so no time bound changes the chunks
        # (and hypothesis sees the same run every time).
        self.scheduler = Scheduler(
            {"lm": self.engine}, max_batch_tokens=12, max_batch_size=4, clock=lambda: 0.0
        )
        self.requests: dict[str, Request] = {}
        self.expect: dict[Job, Expect] = {}
        self.serial = 0

    # ------------------------------------------------------------------ submitting

    def _submit(self, request: Request, op: str, inputs: dict[str, Any], never: bool) -> None:
        job = Job("lm", Step(request.rid, op, inputs), owner=request.rid)
        self.scheduler.submit(job)
        request.jobs.append(job)
        self.expect[job] = Expect(request, never)

    # Prompts that fill whole blocks make pools full of requests that all need more.
    @rule(n=st.one_of(st.integers(1, 40), st.sampled_from([8, 12, 16])))
    def admit(self, n: int) -> None:
        self.serial += 1
        request = Request(f"r{self.serial}")
        self.requests[request.rid] = request
        tokens = [i % VOCAB for i in range(n)]
        self._submit(request, "prefill", {"tokens": tokens}, -(-n // BLOCK_SIZE) > BLOCKS)

    def _pick(self, data: st.DataObject, ready: list[Request]) -> Request:
        return data.draw(st.sampled_from(sorted(ready, key=lambda r: r.rid)))

    def _ready(self) -> list[Request]:
        return [r for r in self.requests.values() if r.idle and r.token is not None]

    @precondition(lambda self: self._ready())
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        request = self._pick(data, self._ready())
        key = request.rid
        never = self.alloc.blocks_needed(key, 1) > BLOCKS - self._pinned(request.rid)
        self._submit(request, "decode", {"token": request.token}, never)

    @precondition(lambda self: self._ready())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        request = self._pick(data, self._ready())
        self._submit(request, "fork", {"seq": f"b{len(request.branches)}"}, False)

    @precondition(lambda self: self._ready())
    @rule(data=st.data(), n=st.integers(1, 20), keep=st.booleans())
    def query(self, data: st.DataObject, n: int, keep: bool) -> None:
        """``extend`` the main sequence, or ``attend`` on it or a branch (attends of one
        request may run side by side)."""
        request = self._pick(data, self._ready())
        x = torch.full((n, 32), 0.1)
        if keep:
            need = self.alloc.blocks_needed(request.rid, n)
            never = need > BLOCKS - self._pinned(request.rid)
            self._submit(request, "extend", {"x": x}, never)
            return
        branches = ["", *request.branches]
        for seq in data.draw(st.lists(st.sampled_from(branches), min_size=1, max_size=3)):
            key = (request.rid, seq) if seq else request.rid
            held = self.alloc.num_tokens(key)
            # The scratch fork shares a partly filled last block, so it copies it first.
            need = -(-(held + n) // BLOCK_SIZE) - -(-held // BLOCK_SIZE)
            need += 1 if held % BLOCK_SIZE else 0
            never = need > BLOCKS - self._pinned(request.rid)
            self._submit(request, "attend", {"x": x, **({"seq": seq} if seq else {})}, never)

    @precondition(lambda self: self._ready())
    @rule(data=st.data(), name=st.sampled_from(["s0", "s1"]))
    def retain(self, data: st.DataObject, name: str) -> None:
        self._submit(self._pick(data, self._ready()), "retain", {"handle": name}, False)

    def _sessions(self) -> list[str]:
        return sorted(h for h, (kind, _, _) in self.engine.handles.items() if kind == "session")

    @precondition(lambda self: self._sessions())
    @rule(data=st.data())
    def attach(self, data: st.DataObject) -> None:
        request = self._new_request()
        handle = data.draw(st.sampled_from(self._sessions()))
        self._submit(request, "attach", {"handle": handle}, False)

    @rule(name=st.sampled_from(sorted(PREFIXES)))
    def prefix(self, name: str) -> None:
        request = self._new_request()
        n = PREFIXES[name]
        tokens = [(i * 7 + len(name)) % VOCAB for i in range(n)]
        never = name not in self.engine.handles and -(-n // BLOCK_SIZE) > BLOCKS
        self._submit(request, "prefix", {"handle": name, "tokens": tokens}, never)

    @precondition(lambda self: self.engine.handles)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        assert self.engine.drop_handle(data.draw(st.sampled_from(sorted(self.engine.handles))))
        self.scheduler.wake()  # memory came free outside any release
        # What a handle pinned is free now: a step judged never to fit beside it may fit.
        for expect in self.expect.values():
            expect.never_fits = False

    def _new_request(self) -> Request:
        self.serial += 1
        request = Request(f"r{self.serial}")
        self.requests[request.rid] = request
        return request

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        request = self._pick(data, list(self.requests.values()))
        removed = self.scheduler.cancel(request.rid)
        assert set(removed) == set(request.jobs)  # nothing is in flight between rounds
        self._forget(request)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self._release(self._pick(data, list(self.requests.values())))

    def _own_blocks(self, handle: str) -> int:
        """Blocks only ``handle`` holds (evicting it frees exactly these)."""
        alloc = self.engine.allocator
        key = HandleKey(handle)
        shared = {b for s in alloc.seq_ids() if s != key for b in alloc.block_table(s)}
        return len(set(alloc.block_table(key)) - shared)

    # ------------------------------------------------------------------ running

    @precondition(lambda self: self.scheduler.has_work)
    @rule()
    def one_round(self) -> None:
        self._resolve(self.scheduler.run_round())

    @rule()
    def drain(self) -> None:
        for _ in range(ROUNDS):
            if not self.scheduler.has_work:
                break
            self._resolve(self.scheduler.run_round())
        assert not self.scheduler.has_work, f"jobs still runnable after {ROUNDS} rounds"
        parked = self.scheduler.parked
        assert {*parked} == {*self.expect}, "a job is neither done, failed nor parked"
        for job in parked:
            what = f"{job.step.op} of {job.step.request_id}"
            assert not self.expect[job].never_fits, f"{what} can never fit but waits"
            assert not self._fits_now(job), f"{what} is parked while memory lets it run"
        if parked:
            # A prefix whose blocks live forks share frees nothing when evicted: only one that
            # holds a block of its own could make room.
            evictable = [
                h
                for h, (kind, _, _) in self.engine.handles.items()
                if kind == "prefix" and self._own_blocks(h)
            ]
            assert not evictable, f"jobs are parked while prefixes {evictable} could be evicted"
            waiting = {job.step.request_id for job in parked}
            holders = {
                r.rid
                for r in self.requests.values()
                if r.rid not in waiting and self._pinned(r.rid)
            }
            assert holders, "jobs are parked but no request a release could free holds memory"

    def _resolve(self, finished: list[tuple[Job, Any]]) -> None:
        for job, outcome in finished:
            expect = self.expect.pop(job, None)
            if expect is None:
                continue  # its request failed by another step of this round and was released
            request = expect.request
            request.jobs.remove(job)
            if isinstance(outcome, KVCacheFull) or (
                # its session was dropped between the submit and the forward
                isinstance(outcome, EngineError) and job.step.op == "attach"
            ):
                self._release(request)  # a failed request is released, as a conductor does
                continue
            assert isinstance(outcome, dict), f"{job.step.op} failed: {outcome!r}"
            assert not expect.never_fits, f"{job.step.op} ran although it could never fit"
            if job.step.op in ("prefill", "decode"):
                request.token = int(outcome["token"])
            elif job.step.op == "fork":
                request.branches.append(str(outcome["seq"]))
            elif job.step.op in ("attach", "prefix"):
                request.token = 1  # its sequence holds the handle's tokens: it may decode

    def _release(self, request: Request) -> None:
        self.scheduler.cancel(request.rid)
        self._forget(request)
        self.scheduler.release(request.rid)
        del self.requests[request.rid]

    def _forget(self, request: Request) -> None:
        for job in request.jobs:
            del self.expect[job]
        request.jobs.clear()

    # ------------------------------------------------------------------ checks

    def _pinned(self, rid: str) -> int:
        return self.engine.admission.pinned(rid)

    def _fits_now(self, job: Job) -> bool:
        step, alloc = job.step, self.alloc
        seq = step.inputs.get("seq")
        key = (step.request_id, seq) if seq else step.request_id
        if step.op == "attend":
            held = alloc.num_tokens(key)
            n = int(step.inputs["x"].shape[0])
            need = -(-(held + n) // BLOCK_SIZE) - -(-held // BLOCK_SIZE)
            return need + (1 if held % BLOCK_SIZE else 0) <= alloc.num_free_blocks
        if step.op == "extend":
            return alloc.can_append(key, int(step.inputs["x"].shape[0]))
        if step.op == "decode":
            return alloc.can_append(key, 1)
        pending = self.engine.cost(step)
        key = _key(step)  # a prefix computes on its build branch
        return alloc.has(key) and alloc.can_append(key, min(step.budget or pending, pending))

    @invariant()
    def no_block_leaks(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_invariants()
        assert self.alloc.num_free_blocks + self.alloc.num_used_blocks == BLOCKS
        for seq in self.alloc.seq_ids():
            if isinstance(seq, HandleKey):
                assert seq.name in self.engine.handles, f"handle {seq.name!r} outlived its drop"
                continue
            owner = seq[0] if isinstance(seq, tuple) else seq
            assert owner in self.requests, f"sequence {seq!r} outlived its request"

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        for request in list(self.requests.values()):
            self._release(request)
        for handle in list(self.engine.handles):
            self.engine.drop_handle(handle)
        assert self.alloc.num_used_blocks == 0 and len(self.alloc) == 0
        assert not self.scheduler.has_work and self.scheduler.parked == []


SchedulerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_over_a_real_kv_engine = pytest.mark.timeout(600)(SchedulerMachine.TestCase)
