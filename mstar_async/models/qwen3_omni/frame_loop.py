"""The talker's frame loop, shared by ``qwen3-omni`` and ``qwen3-tts`` (engines in brackets)::

    talker_prefill [talker] --> ( predictor_prefill [predictor]
                                  -> Loop(predictor [predictor], G-2)   codebooks 1..G-1
                                  -> talker [talker] )                  DynamicLoop: one frame

Each iteration the code predictor starts from the talker's last hidden state and codebook 0
(``context``) and makes the frame's other codebooks; the talker step puts the frame out and
samples the next frame's codebook 0; the loop ends at the walk parameter ``max_frames`` or at
codec end of speech. The talker's nodes and what else they read are each model's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from mstar_async.graph import DynamicLoop, Edge, Loop, LoopStep, Node, Sequential
from mstar_async.models.qwen3_omni.decoder import Qwen3Config, Qwen3Stack
from mstar_async.models.qwen3_omni.embeds_engine import EmbedsKVEngine, EmbedsOp

__all__ = ["Placement", "frame_edges", "frame_loop", "predictor_nodes", "stack_engine"]


class Placement(Protocol):
    """Where a model's engines run: its weights' dtype and device."""

    dtype: torch.dtype
    device: str


def stack_engine(
    stack: Qwen3Stack,
    shape: Qwen3Config,
    ops: Mapping[str, EmbedsOp],
    kv_cache_bytes: int,
    where: Placement,
) -> EmbedsKVEngine:
    """An ``EmbedsKVEngine`` over a decoder ``stack`` of ``shape`` (the talker or the code
    predictor). Raises ValueError as ``EmbedsKVEngine`` does."""
    return EmbedsKVEngine(
        stack,
        shape.attention_spec(where.dtype),
        ops,
        num_layers=shape.num_hidden_layers,
        kv_cache_bytes=kv_cache_bytes,
        device=where.device,
    )


def predictor_nodes() -> list[Node]:
    """``predictor_prefill`` (codebook 1 from the talker's ``context``) and ``predictor`` (each
    further codebook)."""
    return [
        Node(
            "predictor_prefill",
            engine="predictor",
            op="prefill",
            inputs=["context", "sampling"],
            outputs=["code", "codes"],
        ),
        Node(
            "predictor",
            engine="predictor",
            op="decode",
            inputs=["code", "codes"],
            outputs=["code", "codes"],
        ),
    ]


def frame_edges() -> list[Edge]:
    """The loop's edges: the talker prefill's codebook 0 and context into the first frame, and
    each predictor step's codes on to the next and to the talker."""
    return [
        Edge("talker_prefill.context", "predictor_prefill.context"),
        Edge("talker_prefill.code", "talker.code"),
        Edge("predictor_prefill.code", "predictor.code"),
        Edge("predictor_prefill.codes", "predictor.codes"),
        Edge("predictor.codes", "talker.codes"),
    ]


def _frames_done(codec_eos: int) -> Callable[[LoopStep], bool]:
    def until(step: LoopStep) -> bool:
        if step.iteration + 1 >= int(step.params["max_frames"]):
            return True
        return int(step.outputs["talker.code"]) == codec_eos

    return until


def frame_loop(
    groups: int,
    codec_eos: int,
    max_iterations: int,
    *,
    carry: Mapping[str, str] | None = None,
    outlives_streams: bool = False,
) -> DynamicLoop:
    """The loop over frames of ``groups`` codebooks; ``carry`` adds the talker's own values
    carried from one frame to the next.

    Raises:
        ValueError: as ``Loop`` and ``DynamicLoop`` do (e.g. fewer than 2 codebooks).
    """
    residual = Loop(
        "predictor",
        iterations=groups - 2,
        carry={"predictor.code": "predictor.code", "predictor.codes": "predictor.codes"},
    )
    return DynamicLoop(
        Sequential("predictor_prefill", residual, "talker"),
        until=_frames_done(codec_eos),
        max_iterations=max_iterations,
        carry={
            "talker.context": "predictor_prefill.context",
            "talker.code": "talker.code",
            **(carry or {}),
        },
        outlives_streams=outlives_streams,
    )
