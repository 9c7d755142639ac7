"""Sizes of the Qwen3-TTS-style model: ``tiny`` (tests), ``small`` (benchmarks), or a real
checkpoint folder (``config.json`` of ``Qwen3TTSForConditionalGeneration`` plus
``speech_tokenizer/config.json`` of the 12 Hz tokenizer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from mstar_async.models.hf_config import known_fields, lower_names
from mstar_async.models.qwen3_omni.code2wav import Code2WavConfig
from mstar_async.models.qwen3_omni.config import codec_ids
from mstar_async.models.qwen3_omni.decoder import Qwen3Config

__all__ = [
    "SIZES",
    "SpeakerEncoderConfig",
    "SpeechDecoderConfig",
    "TTSConfig",
    "with_released_encoders",
]

SAMPLE_RATE = 24_000
#: PCM samples per codec frame of the 12 Hz tokenizer (12.5 frames a second at 24 kHz).
FRAME_SAMPLES = 1920


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """The ECAPA-TDNN speaker encoder (upstream ``speaker_encoder_config`` field names)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SAMPLE_RATE

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> SpeakerEncoderConfig:
        """Read upstream's dict; absent keys keep upstream's defaults. Raises nothing."""
        return cls(**known_fields(cls, config))


@dataclass(frozen=True)
class SpeechDecoderConfig(Code2WavConfig):
    """The 12 Hz tokenizer's decoder (upstream ``decoder_config`` field names): code2wav's
    sizes, and its quantizer's vector width and the latent width around the transformer."""

    codebook_dim: int = 512
    latent_dim: int = 1024


@dataclass(frozen=True)
class TTSConfig:
    """Everything the builder needs besides the tokenizer.

    ``tts_*`` ids of ``None`` sit right after the tokenizer's vocabulary (a seeded model over a
    tokenizer without them). Codec ids are in the talker's vocabulary; ``speakers`` and
    ``languages`` map lower-case names to codec ids. ``encoder`` is the 12 Hz tokenizer's
    encoder config (a ``MimiConfig`` dict) and ``speaker_encoder`` the ECAPA-TDNN's; either
    ``None`` for a checkpoint that cannot clone voices (upstream's CustomVoice models).
    """

    talker: Qwen3Config
    predictor: Qwen3Config
    decoder: SpeechDecoderConfig
    talker_vocab: int
    text_vocab: int
    text_hidden_size: int
    num_code_groups: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_think: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    speakers: tuple[tuple[str, int], ...] = ()
    languages: tuple[tuple[str, int], ...] = ()
    tts_bos: int | None = None
    tts_eos: int | None = None
    tts_pad: int | None = None
    speaker_encoder: SpeakerEncoderConfig | None = None
    encoder: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)
    seed: int = 0

    def __post_init__(self) -> None:
        """Raises ValueError: sizes that do not fit together."""
        if self.decoder.num_quantizers != self.num_code_groups:
            raise ValueError(
                f"the speech decoder has {self.decoder.num_quantizers} quantizers but the talker "
                f"makes {self.num_code_groups} codebooks per frame"
            )
        if self.num_code_groups < 3:
            raise ValueError(f"num_code_groups must be >= 3, got {self.num_code_groups}")
        enc = self.speaker_encoder
        if enc is not None and enc.enc_dim != self.talker.hidden_size:
            raise ValueError(
                f"the speaker encoder makes {enc.enc_dim}-wide embeddings but the talker is "
                f"{self.talker.hidden_size} wide (they are one row of its prompt)"
            )

    @property
    def codebook_size(self) -> int:
        """Codes per codebook."""
        return self.decoder.codebook_size

    @property
    def can_clone(self) -> bool:
        """Whether reference audio can be turned into a voice (both encoders present)."""
        return self.speaker_encoder is not None and self.encoder is not None

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]) -> TTSConfig:
        """Read ``config.json`` and ``speech_tokenizer/config.json`` dicts.

        Raises:
            ValueError: a section or key is missing.
        """
        try:
            talker = config["talker_config"]
            predictor = talker["code_predictor_config"]
            decoder = tokenizer_config["decoder_config"]
        except KeyError as missing:
            raise ValueError(f"Qwen3-TTS config lacks {missing}") from None
        base = config.get("tts_model_type", "base") == "base"
        speaker = config.get("speaker_encoder_config") if base else None
        encoder = dict(tokenizer_config.get("encoder_config") or {}) if base else None
        if encoder is not None:
            encoder["_valid_quantizers"] = int(
                tokenizer_config.get("encoder_valid_num_quantizers", 16)
            )
        groups = int(talker.get("num_code_groups", 32))
        return cls(
            talker=Qwen3Config.from_hf(talker),
            predictor=Qwen3Config.from_hf(predictor),
            decoder=SpeechDecoderConfig.from_hf(decoder),
            talker_vocab=int(talker["vocab_size"]),
            text_vocab=int(talker.get("text_vocab_size", 151936)),
            text_hidden_size=int(talker.get("text_hidden_size", 2048)),
            num_code_groups=groups,
            **codec_ids(talker),
            codec_think=int(talker.get("codec_think_id", 4202)),
            speakers=lower_names(talker.get("spk_id")),
            languages=lower_names(talker.get("codec_language_id")),
            tts_bos=config.get("tts_bos_token_id"),
            tts_eos=config.get("tts_eos_token_id"),
            tts_pad=config.get("tts_pad_token_id"),
            speaker_encoder=None if speaker is None else SpeakerEncoderConfig.from_hf(speaker),
            encoder=encoder,
        )


def tiny_mimi(codebook: int, groups: int) -> dict[str, Any]:
    """A small ``MimiConfig`` dict at the released frame rate (12.5 Hz at 24 kHz): the
    released strides, narrow layers."""
    return {
        "sampling_rate": SAMPLE_RATE,
        "frame_rate": 12.5,
        "audio_channels": 1,
        "hidden_size": 32,
        "num_filters": 4,
        "num_residual_layers": 1,
        "upsampling_ratios": [8, 6, 5, 4],
        "kernel_size": 7,
        "last_kernel_size": 3,
        "residual_kernel_size": 3,
        "dilation_growth_rate": 2,
        "compress": 2,
        "use_causal_conv": True,
        "trim_right_ratio": 1.0,
        "codebook_size": codebook,
        "codebook_dim": 16,
        "vector_quantization_hidden_dimension": 16,
        "num_quantizers": groups,
        "num_semantic_quantizers": 1,
        "upsample_groups": 32,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 8000,
        "sliding_window": 250,
        "use_cache": False,
        "_valid_quantizers": groups,
    }


#: The released tokenizer encoder's widths (``MimiModel``'s: a 64-filter SEANet, an 8-layer
#: 512-wide transformer, 256-wide quantizer vectors), over ``tiny_mimi``'s strides.
_RELEASED_MIMI: dict[str, Any] = {
    "hidden_size": 512,
    "num_filters": 64,
    "codebook_dim": 256,
    "vector_quantization_hidden_dimension": 256,
    "upsample_groups": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
}


def with_released_encoders(cfg: TTSConfig) -> TTSConfig:
    """``cfg`` with both encoders at the released checkpoints' shapes (ECAPA-TDNN of 512
    channels, the Mimi encoder's widths), their outputs sized to ``cfg``'s talker: what
    cloning a voice costs with real encoders, for the seeded sizes whose own encoders are
    narrow (seeded weights; ``mstar bench speech --encoders released``)."""
    codebook, groups = cfg.codebook_size, cfg.num_code_groups
    return replace(
        cfg,
        speaker_encoder=SpeakerEncoderConfig(enc_dim=cfg.talker.hidden_size),
        encoder={**tiny_mimi(codebook, groups), **_RELEASED_MIMI},
    )


def _sized(
    *,
    talker: Qwen3Config,
    predictor: Qwen3Config,
    codebook: int,
    groups: int,
    decoder: SpeechDecoderConfig,
    speaker: SpeakerEncoderConfig,
    text_hidden: int,
) -> TTSConfig:
    # Codec specials sit right above the codebook, in upstream's order (pad, bos, eos at +0..2,
    # think ids at +6..9); speakers and languages after them.
    return TTSConfig(
        talker=talker,
        predictor=predictor,
        decoder=decoder,
        talker_vocab=codebook + 24,
        text_vocab=0,  # the tokenizer's vocabulary + the three tts ids, set by the builder
        text_hidden_size=text_hidden,
        num_code_groups=groups,
        codec_pad=codebook,
        codec_bos=codebook + 1,
        codec_eos=codebook + 2,
        codec_think=codebook + 6,
        codec_nothink=codebook + 7,
        codec_think_bos=codebook + 8,
        codec_think_eos=codebook + 9,
        speakers=(("vivian", codebook + 12), ("ryan", codebook + 13)),
        languages=(("english", codebook + 16), ("chinese", codebook + 17)),
        speaker_encoder=speaker,
        encoder=tiny_mimi(codebook, groups),
    )


def _stack(hidden: int, layers: int, heads: int, kv: int) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=16,
        rope_theta=10_000.0,
    )


_TINY = _sized(
    talker=_stack(64, 2, 4, 2),
    predictor=_stack(32, 1, 2, 1),
    codebook=64,
    groups=4,
    decoder=SpeechDecoderConfig(
        codebook_size=64,
        codebook_dim=32,
        hidden_size=32,
        latent_dim=48,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
        num_quantizers=4,
        decoder_dim=32,
    ),
    speaker=SpeakerEncoderConfig(
        enc_dim=64,
        enc_channels=(32, 32, 32, 32, 96),
        enc_attention_channels=16,
        enc_se_channels=16,
    ),
    text_hidden=48,
)

_SMALL = _sized(
    talker=replace(_stack(256, 4, 8, 2), head_dim=32),
    predictor=replace(_stack(128, 2, 4, 2), head_dim=32),
    codebook=256,
    groups=8,
    decoder=SpeechDecoderConfig(
        codebook_size=256,
        codebook_dim=64,
        hidden_size=128,
        latent_dim=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=256,
        num_hidden_layers=2,
        num_quantizers=8,
        decoder_dim=128,
    ),
    speaker=SpeakerEncoderConfig(
        enc_dim=256,
        enc_channels=(64, 64, 64, 64, 192),
        enc_attention_channels=32,
        enc_se_channels=32,
    ),
    text_hidden=192,
)

#: Seeded sizes by name.
SIZES: dict[str, TTSConfig] = {"tiny": _TINY, "small": _SMALL}
