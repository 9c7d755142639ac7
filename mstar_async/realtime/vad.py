"""Silero VAD (v5/v6, 16 kHz) in torch: speech probability per 32 ms frame, batched across streams.

The network, as the ``silero-vad`` package ships it (``silero_vad.jit``, its default model): each
frame is 512 new samples after the previous frame's last 64 (zeros before the first), reflect-
padded by 64 on the right; a strided convolution computes a 256-point STFT (stride 128, so 4
columns), its magnitude goes through four convolutions (129 -> 128 -> 64 -> 64 -> 128 channels,
the middle two halving the time axis to 1), an LSTM cell carries the stream's state (h, c of 128
each) from frame to frame, and a 1x1 convolution with a sigmoid gives the probability.

``VADEngine`` runs one frame of any number of streams as one batch (a realtime session's audio
is one stream). The weights are the 16 kHz branch of the TorchScript file in the
installed ``silero-vad`` wheel, read without importing the package (importing it sets torch's
thread count to 1 for the whole process); only its tensors are used, never its code. (The
wheel's ``silero_vad_16k.safetensors`` holds other weights than its default model.)
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar_async.engines.base import Step, StepResult
from mstar_async.errors import EngineError, MstarError

SAMPLE_RATE = 16_000
FRAME = 512
"""New samples per frame: 32 ms at 16 kHz."""
CONTEXT = 64
"""Samples of the previous frame each frame sees first."""
STATE_SHAPE = (2, 128)
"""One stream's state: the LSTM cell's ``h`` and ``c``."""
WEIGHTS = "silero_vad.jit"
#: Our parameter names -> the TorchScript file's (its 16 kHz model).
_NAMES = {
    "stft_conv.weight": "_model.stft.forward_basis_buffer",
    **{
        f"conv{i + 1}.{p}": f"_model.encoder.{i}.reparam_conv.{p}"
        for i in range(4)
        for p in ("weight", "bias")
    },
    **{
        f"lstm_cell.{p}": f"_model.decoder.rnn.{p}"
        for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    },
    **{f"final_conv.{p}": f"_model.decoder.decoder.2.{p}" for p in ("weight", "bias")},
}


class VADWeightsMissing(MstarError):
    """The ``silero-vad`` package (whose wheel carries the weights) is not installed."""


class SileroVAD(nn.Module):
    """The 16 kHz Silero VAD network; parameter names match the package's safetensors file."""

    def __init__(self) -> None:
        super().__init__()
        self.stft_conv = nn.Conv1d(1, 258, kernel_size=256, stride=128, bias=False)
        self.conv1 = nn.Conv1d(129, 128, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(128, 64, kernel_size=3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(64, 64, kernel_size=3, stride=2, padding=1)
        self.conv4 = nn.Conv1d(64, 128, kernel_size=3, padding=1)
        self.lstm_cell = nn.LSTMCell(128, 128)
        self.final_conv = nn.Conv1d(128, 1, kernel_size=1)

    def forward(
        self, frames: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``frames``: ``(B, CONTEXT + FRAME)`` samples in [-1, 1]; ``state``: ``(B, 2, 128)``.
        Returns the speech probability ``(B,)`` and the next state ``(B, 2, 128)``. Pure."""
        x = nn.functional.pad(frames, (0, CONTEXT), mode="reflect").unsqueeze(1)
        spectrum = self.stft_conv(x)
        bins = spectrum.shape[1] // 2
        x = torch.sqrt(spectrum[:, :bins] ** 2 + spectrum[:, bins:] ** 2)
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            x = torch.relu(conv(x))
        h, c = self.lstm_cell(x.squeeze(-1), (state[:, 0], state[:, 1]))
        probability = torch.sigmoid(self.final_conv(torch.relu(h).unsqueeze(-1))).mean(dim=(1, 2))
        return probability, torch.stack((h, c), dim=1)


def weights_path() -> Path:
    """The safetensors file inside the installed ``silero-vad`` package.

    Raises:
        VADWeightsMissing: the package is not installed (names the install command).
    """
    spec = importlib.util.find_spec("silero_vad")
    locations = None if spec is None else spec.submodule_search_locations
    if not locations:
        raise VADWeightsMissing(
            "server VAD needs the Silero VAD weights from the 'silero-vad' package; "
            "install it with: pip install silero-vad"
        )
    path = Path(next(iter(locations))) / "data" / WEIGHTS
    if not path.is_file():
        raise VADWeightsMissing(f"the installed silero-vad package has no {path.name}")
    return path


def load_vad(path: Path | None = None) -> SileroVAD:
    """The network with the package's weights (or those of the TorchScript file at ``path``),
    in eval mode, fp32.

    Raises:
        VADWeightsMissing: as ``weights_path``.
        KeyError: the file lacks one of the network's tensors.
    """
    with warnings.catch_warnings():
        # The wheel ships its default model only as TorchScript (and ONNX); torch 2.13 marks
        # ``jit.load`` deprecated. Only the tensors are kept.
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.load(str(path or weights_path()), map_location="cpu")  # type: ignore[no-untyped-call]
    tensors = scripted.state_dict()
    model = SileroVAD()
    model.load_state_dict({ours: tensors[theirs] for ours, theirs in _NAMES.items()}, strict=True)
    return model.eval()


def frames_tensor(chunks: Sequence[Any]) -> torch.Tensor:
    """Stack chunks of 16 kHz samples into ``(B, CONTEXT + FRAME)`` frames: each chunk's data is
    up to ``CONTEXT`` samples of context then up to ``FRAME`` new ones; a missing context (the
    stream's first frame) is zeros on the left, a short last frame zeros on the right."""
    out = torch.zeros(len(chunks), CONTEXT + FRAME)
    for i, chunk in enumerate(chunks):
        data = torch.as_tensor(chunk.data, dtype=torch.float32).reshape(-1)
        context = data[: chunk.context][-CONTEXT:]
        new = torch.as_tensor(chunk.new, dtype=torch.float32).reshape(-1)[:FRAME]
        out[i, CONTEXT - context.numel() : CONTEXT] = context
        out[i, CONTEXT : CONTEXT + new.numel()] = new
    return out


class VADEngine:
    """Runs the network over one frame of many streams per forward (op ``detect``: input
    ``audio``, a chunk of up to ``CONTEXT`` + ``FRAME`` samples; output ``speech``, the
    probability as a float). Each stream's LSTM state (1 KB) stays here between its frames,
    keyed by request, until ``release``: a walk input's stream fires its node once per chunk,
    so the state cannot ride a loop's carry.
    """

    def __init__(self, model: SileroVAD | None = None) -> None:
        self.model = model if model is not None else load_vad()
        self._states: dict[str, torch.Tensor] = {}

    @property
    def streams(self) -> int:
        """Streams whose state is held (for leak checks)."""
        return len(self._states)

    def cost(self, step: Step) -> int:
        """One frame."""
        return 1

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """One frame of each step's stream, as one batch.

        Raises:
            EngineError: an op other than ``detect``, or a step without ``audio``.
        """
        for step in steps:
            if step.op != "detect" or "audio" not in step.inputs:
                raise EngineError(f"the VAD runs op 'detect' on input 'audio', got {step.op!r}")
        zeros = torch.zeros(STATE_SHAPE)
        states = torch.stack([self._states.get(s.request_id, zeros) for s in steps])
        with torch.inference_mode():
            speech, after = self.model(frames_tensor([s.inputs["audio"] for s in steps]), states)
        results: list[StepResult] = []
        for i, step in enumerate(steps):
            self._states[step.request_id] = after[i].clone()
            results.append({"speech": float(speech[i])})
        return results

    def release(self, request_id: str) -> None:
        """Forget the stream's state; idempotent."""
        self._states.pop(request_id, None)

    def export_state(self, request_id: str) -> torch.Tensor | None:
        """The stream's state (kept here until ``release``); ``None`` before its first frame.
        Never raises."""
        return self._states.get(request_id)

    def import_state(self, request_id: str, state: Any) -> None:
        """Take over a stream's state from ``export_state``.

        Raises:
            EngineError: the stream already has a state here.
        """
        if state is None:
            return
        if request_id in self._states:
            raise EngineError(f"the VAD already holds a state for {request_id}")
        self._states[request_id] = torch.as_tensor(state).reshape(STATE_SHAPE)
