"""A walk split into per-rank segments: which walks split."""

from __future__ import annotations

from mstar_async.graph import DynamicLoop, NodeRef
from mstar_async.graph.segments import split_walk
from mstar_async.models import build_model


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
