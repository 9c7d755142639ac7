"""``AudioInEngine``: the audio encoder as a node, encoding each request's speech while it
streams in.

Op ``encode``: input ``pcm``, a chunk of 16 kHz samples (a walk's streamed input, cut by its
policy; ``final`` on the last chunk of the utterance) -> ``rows`` (the encoder rows this chunk
completed, ``[n, hidden]``, often ``n`` = 0) and ``frames`` (mel frames of the utterance through
the encoder's convolutions so far). One forward does the ready work of every request in it at
once (``encode_streams``: one convolution batch, one attention batch). A request's state (its
``LogMelStream`` and ``AudioEncoderStream``) lives here between its chunks, as the VAD's does,
since a streamed input fires its node once per chunk and cannot carry state; the final chunk
drops it, so a request may encode several utterances one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar_async.engines.base import Step, StepResult
from mstar_async.errors import EngineError
from mstar_async.models.qwen3_omni.audio_encoder import AudioEncoder
from mstar_async.models.qwen3_omni.audio_features import LogMelStream
from mstar_async.models.qwen3_omni.audio_prompt import check_length
from mstar_async.models.qwen3_omni.audio_stream import AudioEncoderStream, encode_streams

__all__ = ["AudioInEngine"]


@dataclass
class _Utterance:
    mel: LogMelStream
    stream: AudioEncoderStream


class AudioInEngine:
    """Runs ``encode`` steps of many requests' utterances in one batch.

    ``max_samples`` bounds one utterance: the chunk that would pass it fails its request (the
    samples are counted before they are featurised). Synchronous; ``forward`` and ``release``
    run on the worker's forward thread, one at a time.
    """

    def __init__(self, encoder: AudioEncoder, *, max_samples: int, device: str = "cpu") -> None:
        self.encoder = encoder
        self.max_samples = max_samples
        self.device = torch.device(device)
        self._utterances: dict[str, _Utterance] = {}

    @property
    def streams(self) -> int:
        """Utterances being encoded (for leak checks)."""
        return len(self._utterances)

    def cost(self, step: Step) -> int:
        """One step per chunk."""
        return 1

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """Featurise and encode each step's chunk; one batch per request seen once (a second
        chunk of a request in the same call waits for the next batch, in order).

        Raises:
            EngineError: an op other than ``encode`` or a step without ``pcm``.
        """
        for step in steps:
            if step.op != "encode" or "pcm" not in step.inputs:
                raise EngineError(f"the audio encoder runs op 'encode' on 'pcm', got {step.op!r}")
        results: list[StepResult] = [None] * len(steps)
        left = list(range(len(steps)))
        with torch.inference_mode():
            while left:
                batch: list[int] = []
                rest: list[int] = []
                seen: set[str] = set()
                for i in left:
                    (rest if steps[i].request_id in seen else batch).append(i)
                    seen.add(steps[i].request_id)
                self._batch([steps[i] for i in batch], results, batch)
                left = rest
        return results

    def _batch(self, steps: list[Step], results: list[StepResult], where: list[int]) -> None:
        ready: list[tuple[int, Step, _Utterance]] = []
        for k, step in zip(where, steps, strict=True):
            try:
                ready.append((k, step, self._push(step)))
            except ValueError as bad:
                self._utterances.pop(step.request_id, None)
                results[k] = EngineError(f"request {step.request_id}: {bad}")
        if not ready:
            return
        rows = encode_streams(self.encoder, [u.stream for _, _, u in ready])
        for (k, step, utterance), new in zip(ready, rows, strict=True):
            results[k] = {"rows": new, "frames": utterance.stream.convolved}
            if utterance.stream.finished:
                del self._utterances[step.request_id]

    def _push(self, step: Step) -> _Utterance:
        """Feed the step's new samples into its utterance (created on its first chunk).

        Raises:
            ValueError: the utterance passes ``max_samples``, or ends shorter than the
                features take (nothing of this chunk is kept then).
        """
        chunk: Any = step.inputs["pcm"]
        utterance = self._utterances.get(step.request_id)
        if utterance is None:
            cfg = self.encoder.config
            utterance = _Utterance(LogMelStream(), AudioEncoderStream(cfg))
            self._utterances[step.request_id] = utterance
        new = torch.as_tensor(chunk.new, dtype=torch.float32).reshape(-1).to(self.device)
        check_length(utterance.mel.samples + new.numel(), self.max_samples, final=False)
        final = bool(chunk.final)
        if final:
            check_length(utterance.mel.samples + new.numel(), self.max_samples, final=True)
        frames = utterance.mel.push(new)
        if final:
            frames = torch.cat([frames, utterance.mel.finish()], dim=1)
        utterance.stream.push(frames.to(self.encoder.proj2.weight.dtype))
        if final:
            utterance.stream.finish()
        return utterance

    def release(self, request_id: str) -> None:
        """Forget the request's utterance in progress; idempotent."""
        self._utterances.pop(request_id, None)

    def export_state(self, request_id: str) -> None:
        """Nothing moves: an utterance is encoded where it started.

        Raises:
            EngineError: an utterance of the request is in progress here.
        """
        if request_id in self._utterances:
            raise EngineError(f"request {request_id}: its utterance is being encoded here")

    def import_state(self, request_id: str, state: Any) -> None:
        """Accepts only ``None`` (see ``export_state``).

        Raises:
            EngineError: a state was given.
        """
        if state is not None:
            raise EngineError("the audio encoder keeps no state that moves between ranks")
