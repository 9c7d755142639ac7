"""The model's parts, each built the first time something asks for it, and only that part.

Parts: the talker (with its code predictor), the speech decoder, and for cloning the speaker
encoder and the speech encoder. Seeded parts are drawn from ``cfg.seed`` in float32 on the CPU,
then cast. From a checkpoint folder (upstream's layout: ``model.safetensors`` with
``talker.*`` and ``speaker_encoder.*``; ``speech_tokenizer/model.safetensors`` with
``decoder.*`` and ``encoder.*``) the talker and the decoder are streamed tensor by tensor into
their final dtype and device (Qwen3-Omni's loader); the two encoders, small and used once per
registered voice, are read whole, strictly. Parts are held weakly, so engines built together
share one talker and a part no one holds is freed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from mstar_async.models.checkpoints import CheckpointError, SafetensorsFolder
from mstar_async.models.checkpoints.streaming import TensorSource, empty_module
from mstar_async.models.qwen3_omni.decoder import seeded_init
from mstar_async.models.qwen3_omni.weights import load_upstream, speak_softly
from mstar_async.models.qwen3_tts.config import TTSConfig
from mstar_async.models.qwen3_tts.speaker_encoder import SpeakerEncoder
from mstar_async.models.qwen3_tts.speech_decoder import SpeechDecoder
from mstar_async.models.qwen3_tts.speech_encoder import SpeechEncoder, upstream_name
from mstar_async.models.qwen3_tts.talker import TTSTalker

__all__ = ["TTSWeights", "build_talker"]


def build_talker(cfg: TTSConfig) -> TTSTalker:
    """The talker (with its code predictor) of ``cfg``, with fresh weights."""
    return TTSTalker(
        cfg.talker,
        vocab=cfg.talker_vocab,
        text_vocab=cfg.text_vocab,
        text_hidden=cfg.text_hidden_size,
        predictor=cfg.predictor,
        codebook_size=cfg.codebook_size,
        groups=cfg.num_code_groups,
    )


def _seed_codebooks(module: nn.Module, seed: int) -> None:
    """Codebooks of a seeded quantizer: unit usage counts, ``N(0, 1)`` vectors (parameters of
    the decoder, buffers of Mimi's encoder), so codes differ and encoding picks real entries."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith("cluster_usage"):
                tensor.fill_(1.0)
            elif name.endswith(("embedding_sum", "embed_sum")):
                tensor.normal_(0.0, 1.0, generator=gen)
            elif name.endswith("initialized"):
                tensor.fill_(1.0)


class TTSWeights:
    """The parts of one built model: seeded when ``folder`` is None, else read from it, in
    ``dtype`` on ``device``, in eval mode. Accessors block while a part is built; thread-safe.

    Accessors raise ``CheckpointError`` (a file missing or unreadable) and ``ValueError``
    (weights that do not match the config); the encoders also ``ValueError`` for a checkpoint
    that cannot clone (no encoder in its config).
    """

    def __init__(
        self, cfg: TTSConfig, folder: Path | None, dtype: torch.dtype, device: str
    ) -> None:
        self.config = cfg
        self.folder = folder
        self.dtype = dtype
        self.device = device
        self._live: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def talker(self) -> TTSTalker:
        """The talker with its code predictor."""
        module = self._part("talker", self._talker)
        assert isinstance(module, TTSTalker)
        return module

    def speech_decoder(self) -> SpeechDecoder:
        """The 12 Hz tokenizer's decoder."""
        module = self._part("speech_decoder", self._decoder)
        assert isinstance(module, SpeechDecoder)
        return module

    def speaker_encoder(self) -> SpeakerEncoder:
        """The ECAPA-TDNN speaker encoder (float32: it runs once per voice)."""
        module = self._part("speaker_encoder", self._speaker)
        assert isinstance(module, SpeakerEncoder)
        return module

    def speech_encoder(self) -> SpeechEncoder:
        """The 12 Hz tokenizer's encoder (float32). Also raises RuntimeError without
        transformers."""
        module = self._part("speech_encoder", self._encoder)
        assert isinstance(module, SpeechEncoder)
        return module

    def _part(self, name: str, build: Callable[[], nn.Module]) -> nn.Module:
        with self._lock:
            module = self._live.get(name)
            if module is None:
                module = build()
                self._live[name] = module
            return module

    def _talker(self) -> nn.Module:
        cfg = self.config
        if self.folder is None:
            module = build_talker(cfg)
            seeded_init(module, cfg.seed + 1)
            return module.to(device=self.device, dtype=self.dtype).eval()
        module = empty_module(lambda: build_talker(cfg))
        source = SafetensorsFolder(self.folder)
        load_upstream(module, source, "talker.", dtype=self.dtype, device=self.device)
        return module

    def _decoder(self) -> nn.Module:
        cfg = self.config
        if self.folder is None:
            module = SpeechDecoder(cfg.decoder)
            seeded_init(module, cfg.seed + 2)
            _seed_codebooks(module, cfg.seed + 2)
            speak_softly(module, cfg.seed + 2)
            return module.to(device=self.device, dtype=self.dtype).eval()
        module = empty_module(lambda: SpeechDecoder(cfg.decoder))
        source = SafetensorsFolder(self.folder / "speech_tokenizer")
        load_upstream(module, source, "decoder.", dtype=self.dtype, device=self.device)
        return module

    def _speaker(self) -> nn.Module:
        cfg = self.config.speaker_encoder
        if cfg is None:
            raise ValueError("this checkpoint has no speaker encoder: it cannot clone voices")
        module = SpeakerEncoder(cfg)
        if self.folder is None:
            seeded_init(module, self.config.seed + 3)
        else:
            _load_whole(module, SafetensorsFolder(self.folder), "speaker_encoder.", str)
        return module.to(self.device).eval()

    def _encoder(self) -> nn.Module:
        cfg = self.config.encoder
        if cfg is None:
            raise ValueError("this checkpoint has no speech encoder: it cannot clone voices")
        module = SpeechEncoder(cfg)
        if self.folder is None:
            seeded_init(module, self.config.seed + 4)
            _seed_codebooks(module, self.config.seed + 4)
        else:
            source = SafetensorsFolder(self.folder / "speech_tokenizer")
            _load_whole(module, source, "encoder.", upstream_name)
        return module.to(self.device).eval()


def _load_whole(
    module: nn.Module, source: TensorSource, prefix: str, rename: Callable[[str], str]
) -> None:
    """Load every parameter and buffer of ``module`` from ``prefix + rename(name)``, strictly
    (missing or extra tensors under ``prefix`` are listed)."""
    names = {k: prefix + rename(k) for k in module.state_dict()}
    available = {n for n in source.shapes() if n.startswith(prefix)}
    missing = sorted(set(names.values()) - available)
    extra = sorted(available - set(names.values()))
    if missing or extra:
        raise ValueError(
            f"checkpoint tensors under {prefix!r} do not match the model: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {extra[:8]}"
        )
    tensors = dict(source.read(sorted(names.values())))
    state = {k: tensors[v] for k, v in names.items()}
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"cannot load {prefix!r} tensors: {exc}") from exc
