"""The model's parts, each built the first time an engine asks for it, and only that part.

A rank builds the parts its engines need and nothing else: the thinker's engine the thinker; the
talker's engine the talker (with its code predictor), and nothing of the thinker (the thinker's
engine sends it the embedding rows it projects: ``thinker_engine``); the code predictor's engine
the code predictor (taken from the talker when that is built); code2wav's engine code2wav; the
audio encoder's engine the thinker's audio tower. From a checkpoint folder a part
is built on the meta device and its tensors are streamed from the safetensors files straight
into their final dtype and device (``checkpoints.streaming``), so a rank reads from disk only its
parts' tensors and never holds a second copy; the vision tower is never read.

Parts are owned by the engines holding them: an ``OmniWeights`` (one per built model) keeps only
weak references, so engines built together share a part (the talker's and the code predictor's
engines one ``Talker``), and a part no engine holds any more is freed.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from mstar_async.models.checkpoints import SafetensorsFolder
from mstar_async.models.checkpoints.streaming import (
    Layout,
    LoadStats,
    Piece,
    TensorSource,
    empty_module,
    load_weights,
)
from mstar_async.models.qwen3_omni.audio_encoder import AudioEncoder
from mstar_async.models.qwen3_omni.code2wav import Code2Wav, FrameDecoder
from mstar_async.models.qwen3_omni.config import OmniConfig
from mstar_async.models.qwen3_omni.decoder import seeded_init
from mstar_async.models.qwen3_omni.talker import CodePredictor, Talker
from mstar_async.models.qwen3_omni.thinker import Thinker

__all__ = ["SEEDED_RMS", "OmniWeights", "load_upstream", "speak_softly", "upstream_layout"]

P = TypeVar("P", bound=nn.Module)

_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# transformers 5 names the thinker's text model ``thinker.model.language_model``; the released
# files name it ``thinker.model``.
_THINKER_TEXT, _THINKER_TEXT_V5 = "thinker.model.", "thinker.model.language_model."
# The audio tower: ``thinker.audio_tower`` in the released files, under ``thinker.model`` in
# transformers 5's in-memory model.
_AUDIO, _AUDIO_V5 = "thinker.audio_tower.", "thinker.model.audio_tower."


def upstream_layout(prefix: str, names: Collection[str]) -> Layout:
    """Where each parameter of a part whose upstream names start with ``prefix`` is among the
    checkpoint's ``names``: the same name under ``prefix``, the thinker's text model under
    either of its upstream prefixes, and each fused expert stack (``experts.gate_up_proj``
    ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``) from the released per-expert matrices
    ``experts.{e}.{gate,up,down}_proj.weight`` when the checkpoint has no fused tensor.
    """

    def present(name: str) -> str:
        if name in names:
            return name
        if name.startswith(_AUDIO):
            renamed = _AUDIO_V5 + name[len(_AUDIO) :]
        elif name.startswith(_THINKER_TEXT):
            renamed = _THINKER_TEXT_V5 + name[len(_THINKER_TEXT) :]
        else:
            return name
        return renamed if renamed in names else name

    def pieces(param: str, shape: tuple[int, ...]) -> Sequence[Piece]:
        name = present(prefix + param)
        fused = _FUSED_EXPERTS.match(param)
        if fused is None or name in names:
            return [Piece(name)]
        experts, which = prefix + fused.group(1), fused.group(2)
        if which == "down_proj":
            return [
                Piece(present(f"{experts}.{e}.down_proj.weight"), (e,)) for e in range(shape[0])
            ]
        half = shape[1] // 2
        return [
            piece
            for e in range(shape[0])
            for piece in (
                Piece(present(f"{experts}.{e}.gate_proj.weight"), (e, slice(0, half))),
                Piece(present(f"{experts}.{e}.up_proj.weight"), (e, slice(half, 2 * half))),
            )
        ]

    return pieces


def load_upstream(
    module: nn.Module,
    source: TensorSource,
    prefix: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    claims: Sequence[str] | None = None,
) -> LoadStats:
    """Fill ``module`` (built with ``empty_module``) from the upstream-named tensors of
    ``source`` under ``prefix`` (see ``upstream_layout``), strictly: every tensor whose name
    starts with one of ``claims`` (default: ``prefix``) must be used. Blocks on the reads.

    Raises:
        ValueError: tensors missing, unexpected or of the wrong shape (listed), before reading.
        CheckpointError: a weight file cannot be read.
    """
    starts = tuple(claims if claims is not None else (prefix,))
    stats = load_weights(
        module,
        source,
        upstream_layout(prefix, source.shapes().keys()),
        dtype=dtype,
        device=device,
        claimed=(lambda name: name.startswith(starts)) if starts else None,
    )
    module.eval()
    return stats


#: The RMS level seeded code2wav weights are scaled to (about -20 dBFS): random weights
#: otherwise drive most samples into the [-1, 1] clamp, which is noise at full scale.
SEEDED_RMS = 0.1


def speak_softly(vocoder: FrameDecoder, seed: int) -> None:
    """Scale a seeded vocoder's last convolution so random codes come out at ``SEEDED_RMS``
    (deterministic for the seed; real checkpoints are never touched). Raises nothing."""
    cfg = vocoder.config
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, cfg.codebook_size, (cfg.num_quantizers, 16), generator=generator)
    last = vocoder.decoder[-1]
    assert isinstance(last, nn.Module)
    with torch.no_grad():
        rms = float(vocoder.unclamped(codes).pow(2).mean().sqrt())
        if rms > 0:
            for param in last.parameters():
                param.mul_(SEEDED_RMS / rms)


def build_talker(cfg: OmniConfig) -> Talker:
    """The talker (with its code predictor) of ``cfg``, with fresh weights (on the meta device
    under ``empty_module``). Raises ``ValueError`` as ``Talker`` does."""
    return Talker(
        cfg.talker,
        vocab=cfg.talker_vocab,
        thinker_hidden=cfg.thinker.hidden_size,
        predictor=cfg.predictor,
        codebook_size=cfg.codebook_size,
        groups=cfg.num_code_groups,
    )


def _build_audio(cfg: OmniConfig) -> AudioEncoder:
    if cfg.audio is None:
        raise ValueError("this config has no audio encoder (no thinker audio_config)")
    return AudioEncoder(cfg.audio)


@dataclass(frozen=True)
class _Part:
    build: Callable[[OmniConfig], nn.Module]
    prefix: str  # of its tensors' upstream names
    claims: tuple[str, ...]  # its tensors that must all be used
    within: tuple[str, str] | None = None  # (part, submodule) it is a piece of
    seed: int = 0  # offset of its seed (seeded parts that are no piece of another)


_PARTS = {
    "thinker": _Part(
        lambda c: Thinker(c.thinker, c.thinker_vocab, c.accept_hidden_layer),
        "thinker.",
        ("thinker.model.", "thinker.lm_head."),  # not the audio and vision towers
    ),
    "talker": _Part(build_talker, "talker.", ("talker.",), seed=1),
    "code_predictor": _Part(
        lambda c: CodePredictor(c.predictor, c.codebook_size, c.num_code_groups),
        "talker.code_predictor.",
        ("talker.code_predictor.",),
        within=("talker", "code_predictor"),
    ),
    "code2wav": _Part(lambda c: Code2Wav(c.code2wav), "code2wav.", ("code2wav.",), seed=2),
    "audio_encoder": _Part(_build_audio, _AUDIO, (_AUDIO, _AUDIO_V5), seed=3),
}


class OmniWeights:
    """The parts of one built model: seeded from ``cfg.seed`` when ``folder`` is None, else
    streamed from the folder's safetensors, in ``dtype`` on ``device``, in eval mode.

    Each accessor returns the live part if an engine still holds it, else builds it (blocking;
    call it where engines are built). Thread-safe: one part is built at a time.
    """

    def __init__(
        self, cfg: OmniConfig, folder: Path | None, dtype: torch.dtype, device: str
    ) -> None:
        self.config = cfg
        self.folder = folder
        self.dtype = dtype
        self.device = device
        #: What each part built from the folder read, in the order they were built.
        self.loads: list[tuple[str, LoadStats]] = []
        self._live: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._source: SafetensorsFolder | None = None

    def thinker(self) -> Thinker:
        """The thinker's text model and head.

        Raises:
            CheckpointError: a weight file is missing or unreadable.
            ValueError: the weights do not match the config.
        """
        return self._part("thinker", Thinker)

    def talker(self) -> Talker:
        """The talker with its code predictor. Raises as ``thinker``."""
        return self._part("talker", Talker)

    def code_predictor(self) -> CodePredictor:
        """The code predictor: the talker's when it is built, else the predictor alone.
        Raises as ``thinker``."""
        return self._part("code_predictor", CodePredictor)

    def code2wav(self) -> Code2Wav:
        """The vocoder. Raises as ``thinker``."""
        return self._part("code2wav", Code2Wav)

    def audio_encoder(self) -> AudioEncoder:
        """The thinker's audio tower (``thinker.audio_tower.*``). Raises as ``thinker``, and
        ValueError for a config without one."""
        return self._part("audio_encoder", AudioEncoder)

    def _part(self, name: str, kind: type[P]) -> P:
        with self._lock:
            module = self._live.get(name)
            if module is None:
                module = self._build(name)
                self._live[name] = module
        assert isinstance(module, kind)
        return module

    def _build(self, name: str) -> nn.Module:
        part = _PARTS[name]
        if part.within is not None:
            whole = self._live.get(part.within[0])
            if whole is not None:
                return whole.get_submodule(part.within[1])
        if self.folder is None:
            return self._seeded(name)
        module = empty_module(lambda: part.build(self.config))
        self._adopt_pieces(name, module)
        if self._source is None:
            self._source = SafetensorsFolder(self.folder)
        stats = load_upstream(
            module,
            self._source,
            part.prefix,
            dtype=self.dtype,
            device=self.device,
            claims=part.claims,
        )
        self.loads.append((name, stats))
        return module

    def _seeded(self, name: str) -> nn.Module:
        # Seeded values depend on every parameter drawn before them, so a piece of a part is
        # cut from the whole part (seeded sizes are small).
        within = _PARTS[name].within
        whole_name, path = within if within is not None else (name, "")
        part = _PARTS[whole_name]
        module = part.build(self.config)
        # ln_post keeps LayerNorm's identity init (seeded_audio_encoder's rule: seeded_init
        # knows norms by a suffix that upstream's name for it lacks).
        skip = ("ln_post",) if isinstance(module, AudioEncoder) else ()
        seeded_init(module, self.config.seed + part.seed, skip=skip)
        if isinstance(module, Code2Wav):
            speak_softly(module, self.config.seed + part.seed)
        module.to(device=self.device, dtype=self.dtype).eval()
        self._adopt_pieces(whole_name, module)
        return module.get_submodule(path) if path else module

    def _adopt_pieces(self, name: str, module: nn.Module) -> None:
        """Put the live pieces of part ``name`` into ``module`` (built now), so they are shared,
        not built twice; loading keeps their materialised parameters."""
        for piece, part in _PARTS.items():
            live = self._live.get(piece)
            if part.within is not None and part.within[0] == name and live is not None:
                module.set_submodule(part.within[1], live)
