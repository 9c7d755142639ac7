"""The dataclasses that travel between processes inside step inputs and outputs."""

from __future__ import annotations

from mstar_async.engines.kv.transfer import SequenceKV
from mstar_async.engines.sampling import SamplingParams
from mstar_async.graph import StreamEnd
from mstar_async.policies import Chunk
from mstar_async.transport import register_wire_type


def register_wire_types() -> None:
    """Register every dataclass our models pass across processes; idempotent.

    Both ends (the conductor's process and each worker) call it before the first message.
    """
    register_wire_type(Chunk, name="mstar.Chunk")
    register_wire_type(StreamEnd, name="mstar.StreamEnd")
    register_wire_type(SamplingParams, name="mstar.SamplingParams")
    register_wire_type(SequenceKV, name="mstar.SequenceKV")
