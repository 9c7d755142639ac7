"""Moving a request's engine state (its KV) from one rank to another, worker to worker.

A request that ran its prefill on rank 0 and runs its decode on rank 1 has its KV on rank 0.
The conductor's ``StartWalk`` to rank 1 names the move (``moves``: engine -> source rank), and
rank 1, before the walk starts, asks rank 0 for the state (``FetchState`` over the peer link).
Rank 0 exports it between forwards and keeps holding it; the tensors travel as the peer links
carry any tensor (shared memory on one host, frames over TCP across hosts), never through the
conductor. Rank 1 imports it through its scheduler (an import without room waits for memory
like a step does), then tells rank 0 to free its copy (``DropState``). So the source frees its
blocks only once the destination holds the state; the destination allocates its own blocks as
it imports (with the write, in one step between forwards), not before the bytes travel. A
cancel during the move stops it where it is; the request's release (which reaches every rank
the request touched) frees whatever either side still holds.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from mstar_async.errors import WorkerLost
from mstar_async.logs import get_logger
from mstar_async.transport import (
    DROP_OP,
    EXPORT_OP,
    IMPORT_OP,
    DropState,
    ErrorInfo,
    FetchState,
    StateReply,
    StepCall,
    TransportError,
)
from mstar_async.worker.tensor_links import WorkerTensors
from mstar_async.worker.walk_loop import WalkLoop

__all__ = ["StateMoves", "state_bytes"]

log = get_logger("mstar_async.worker.state")


class StateMoves:
    """One worker's side of state moves: taking a request's state from a peer, and giving one
    (a ``StateGiver`` for ``WorkerTensors.serve``). Counts what it moved (``stats``)."""

    def __init__(self, loop: WalkLoop, tensors: WorkerTensors) -> None:
        self.loop = loop
        self.tensors = tensors
        self.taken = 0
        self.bytes_taken = 0
        self.fetch_s = 0.0  # asking until the state was here (the source's export included)
        self.import_s = 0.0
        self.given = 0
        self.export_s = 0.0  # asked until exported (waiting for a gap between forwards too)

    def stats(self) -> dict[str, int]:
        """``state_moves_in``, ``state_bytes_in``, ``state_fetch_us``, ``state_import_us``,
        ``state_moves_out`` and ``state_export_us``. Never raises."""
        return {
            "state_moves_in": self.taken,
            "state_bytes_in": self.bytes_taken,
            "state_fetch_us": int(self.fetch_s * 1e6),
            "state_import_us": int(self.import_s * 1e6),
            "state_moves_out": self.given,
            "state_export_us": int(self.export_s * 1e6),
        }

    async def take(self, request_id: str, engine: str, source: int) -> None:
        """Bring ``request_id``'s state in ``engine`` here from rank ``source``, then tell
        ``source`` to free its copy. Cancel-safe: a cancelled move leaves what either side holds
        to the request's release.

        Raises:
            WorkerLost: ``source`` could not be reached (its worker died or restarted).
            EngineError, KVCacheFull, MstarError: the export or the import failed.
        """
        me = self.tensors.store.rank
        started = time.perf_counter()
        question = FetchState(request_id, engine, self.tensors.next_id())
        what = f"request {request_id}'s {engine!r} state"
        try:
            reply = await self.tensors.ask(source, question, what)
        except TransportError as exc:
            raise WorkerLost(
                f"rank {source} was lost while {what} moved to rank {me}: {exc}"
            ) from exc
        assert isinstance(reply, StateReply)
        if reply.error is not None:
            raise reply.error.to_exception()
        fetched = time.perf_counter()
        await self.loop.submit(StepCall(request_id, engine, IMPORT_OP, {"state": reply.state}))
        self.fetch_s += fetched - started
        self.import_s += time.perf_counter() - fetched
        self.taken += 1
        self.bytes_taken += state_bytes(reply.state)
        try:
            await self.tensors.send(source, DropState(request_id, engine))
        except TransportError as exc:  # gone: what it held went with it
            log.warning("state.drop_unsent", request=request_id, rank=source, error=str(exc))

    async def give(self, question: FetchState) -> StateReply:
        """Export the request's state in that engine between forwards; it stays held here
        until ``drop`` (or the request's release). Never raises: a failure is the reply.
        Cancel-safe: a cancelled export leaves the state held, for the release to free."""
        call = StepCall(question.request_id, question.engine, EXPORT_OP, {})
        started = time.perf_counter()
        try:
            outputs = await self.loop.submit(call)
        except Exception as exc:
            return StateReply(question.id, error=ErrorInfo.from_exception(exc))
        self.export_s += time.perf_counter() - started
        self.given += 1
        return StateReply(question.id, outputs["state"])

    async def drop(self, message: DropState) -> None:
        """Free the request's state in that engine here: it has arrived on another rank.
        Never raises. Cancel-safe: a drop cancelled before it ran leaves the state to the
        request's release."""
        call = StepCall(message.request_id, message.engine, DROP_OP, {})
        try:
            await self.loop.submit(call)
        except Exception as exc:  # released meanwhile, or the engine failed: nothing to keep
            log.warning("state.drop_failed", request=message.request_id, error=repr(exc))


def state_bytes(state: Any) -> int:
    """The bytes of every tensor in ``state`` (dicts, lists, tuples and dataclasses walked).
    Never raises."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return sum(state_bytes(getattr(state, f.name)) for f in dataclasses.fields(state))
    return 0
