"""A walk split into per-rank segments: which walks split, and two segments wired directly to
each other (what the conductor relays, passed at once) give the answers of one whole run, in
the same order."""

from __future__ import annotations

from typing import Any

import torch

from mstar_async.engines import Step
from mstar_async.graph import DynamicLoop, Model, NodeRef, PortRef, WalkPlan
from mstar_async.graph.segments import split_walk
from mstar_async.models import build_model
from mstar_async.walks.run import WalkRun
from mstar_async.walks.segment import DONE, END, ITEMS, VALUE, SegmentRun
from mstar_async.walks.trampoline import StepRequest, Task, Trampoline
from tests.worker.models import build_two_ranks


def test_a_walk_splits_when_each_loop_sits_on_one_rank() -> None:
    demo = build_model("demo")
    speak = demo.plan("speak")
    split = split_walk(speak, {"step": 0, "codec": 1})
    assert split is not None and split.ranks == (0, 1)
    loop, codec = speak.walk.body.children  # type: ignore[union-attr]
    assert isinstance(loop, DynamicLoop) and isinstance(codec, NodeRef)
    # The loop is rank 0's unit, the codec rank 1's; the codes cross as a stream.
    assert split.segments[0].reports == {loop: 0} and split.segments[0].waits == {codec: 1}
    assert split.segments[1].reports == {codec: 1} and split.segments[1].waits == {loop: 0}
    (key,) = split.cross
    assert key == "codec.codes" and split.cross[key].edge.streaming
    assert list(split.segments[0].sends.values()) == [key] and not split.segments[0].receives
    assert list(split.segments[1].receives) == [key] and not split.segments[1].sends
    # A guidance step on another rank than the denoiser splits the denoising loop: no split.
    image = demo.plan("image")
    assert split_walk(image, {"cond": 0, "uncond": 0, "guide": 1, "vae": 0}) is None
    assert split_walk(image, {"cond": 0, "uncond": 0, "guide": 0, "vae": 1}) is not None


class _Rank:
    """One rank: a trampoline whose steps run at once on the model's engines, logged."""

    def __init__(self, model: Model, log: list[str]) -> None:
        self.engines = {name: factory() for name, factory in model.components.items()}
        self.log = log
        self.trampoline = Trampoline(self._submit)
        self.run: WalkRun | None = None
        self.outputs: list[tuple[str, float]] = []
        self.ends: list[tuple[dict[PortRef, Any], BaseException | None]] = []
        self.other: _Rank | None = None

    def _submit(self, task: Task, request: StepRequest) -> None:
        self.log.append(request.node)
        step = Step(request.request_id, request.op, request.inputs)
        self.trampoline.wake(task, self.engines[request.engine].forward([step])[0])

    # The sink: outputs read at once, relays passed straight to the other rank.
    def emit(self, port: str, value: Any, iteration: int) -> None:
        assert self.run is not None
        self.outputs.append((port, float(value)))
        self.run.ack(1)

    def end(self, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        self.ends.append((persisted, error))

    def relay(self, kind: str, key: Any, value: Any) -> None:
        assert self.other is not None and isinstance(self.other.run, SegmentRun)
        run, mine = self.other.run, self.run
        assert mine is not None
        if kind == ITEMS:
            run.feed(PortRef.parse(key, role="edge"), value, lambda: mine.ack(1))
        elif kind == END:
            run.end_input(PortRef.parse(key, role="edge"))
        elif kind == VALUE:
            run.set_value(PortRef.parse(key, role="edge"), value)
        else:
            assert kind == DONE
            run.block_done(key)


INPUTS = {
    PortRef("head", "x"): torch.tensor(0),
    PortRef("head", "g"): torch.tensor(2.0),
    PortRef("sink", "delay"): torch.tensor(0.0),
}


def _whole(model: Model, plan: WalkPlan, log: list[str]) -> _Rank:
    rank = _Rank(model, log)
    rank.run = WalkRun(plan, "r", INPUTS, {"n": 9}, {}, rank.trampoline, rank)
    rank.run.start()
    rank.trampoline.run_ready()
    return rank


def test_two_segments_give_the_whole_runs_answers_in_its_order() -> None:
    model = build_two_ranks()
    plan = model.plan("w")
    whole_log: list[str] = []
    whole = _whole(model, plan, whole_log)
    assert whole.ends == [({}, None)]

    split = split_walk(plan, {"head": 0, "count": 0, "sink": 1, "tail": 0})
    assert split is not None
    log: list[str] = []
    ranks = [_Rank(model, log), _Rank(model, log)]
    ranks[0].other, ranks[1].other = ranks[1], ranks[0]
    for number, rank in enumerate(ranks):
        inputs = {ref: v for ref, v in INPUTS.items() if split.node_ranks[ref.node] == number}
        segment = split.segments[number]
        # One output in flight: the producer waits while the consumer's buffer is full.
        rank.run = SegmentRun(
            plan, "r", inputs, {"n": 9}, {}, rank.trampoline, rank, segment, window=1
        )
    for rank in ranks:
        assert rank.run is not None
        rank.run.start()
    while any(rank.trampoline.ready for rank in ranks):
        for rank in ranks:
            rank.trampoline.run_ready()

    assert [rank.ends for rank in ranks] == [[({}, None)], [({}, None)]]
    assert ranks[1].outputs == [o for o in whole.outputs if o[0] == "sink.out"]
    assert (
        ranks[0].outputs == [o for o in whole.outputs if o[0] == "tail.z"] == [("tail.z", 1018.0)]
    )
    # Each node ran where it sits, as often as in one run; sink consumed while the loop on
    # the other rank still counted (a pipeline), and tail ran after sink had finished.
    assert sorted(log) == sorted(whole_log)
    assert log.index("sink") < len(log) - 1 - log[::-1].index("count")
    assert log[-1] == "tail" and log.count("tail") == 1
