"""Sizes of the Qwen3-Omni-style model: ``tiny`` (tests), ``small`` (benchmarks), or a real
checkpoint's ``config.json`` (``Qwen3OmniMoeForConditionalGeneration``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from mstar_async.models.hf_config import lower_names
from mstar_async.models.qwen3_omni.audio_encoder import AudioEncoderConfig
from mstar_async.models.qwen3_omni.code2wav import Code2WavConfig
from mstar_async.models.qwen3_omni.decoder import Qwen3Config

__all__ = ["SIZES", "OmniConfig", "codec_ids"]

SAMPLE_RATE = 24_000


def codec_ids(talker: Mapping[str, Any]) -> dict[str, int]:
    """The codec special ids both Qwen3 speech models read from an upstream ``talker_config``
    dict (upstream's defaults for absent keys), by our config fields' names.

    Raises:
        ValueError, TypeError: an id that is not an integer.
    """
    return {
        "codec_pad": int(talker.get("codec_pad_id", 4196)),
        "codec_bos": int(talker.get("codec_bos_id", 4197)),
        "codec_eos": int(talker.get("codec_eos_token_id", 4198)),
        "codec_nothink": int(talker.get("codec_nothink_id", 4203)),
        "codec_think_bos": int(talker.get("codec_think_bos_id", 4204)),
        "codec_think_eos": int(talker.get("codec_think_eos_id", 4205)),
    }


@dataclass(frozen=True)
class OmniConfig:
    """Everything the builder needs besides the tokenizer.

    ``tts_*`` ids of ``None`` are placed right after the tokenizer's vocabulary (a seeded model
    over a tokenizer that has no such tokens); codec ids are in the talker's vocabulary.
    ``audio`` is the thinker's audio encoder (``None``: a config without one); ``audio_*``
    are the thinker's ids of ``<|audio_start|>``, ``<|audio_pad|>`` (upstream's
    ``audio_token_id``) and ``<|audio_end|>``, ``None`` where the tokenizer (or, seeded, the
    three ids after the tts ids) gives them.
    """

    thinker: Qwen3Config
    talker: Qwen3Config
    predictor: Qwen3Config
    code2wav: Code2WavConfig
    thinker_vocab: int
    talker_vocab: int
    num_code_groups: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    speakers: tuple[tuple[str, int], ...] = ()
    tts_bos: int | None = None
    tts_eos: int | None = None
    tts_pad: int | None = None
    seed: int = 0
    audio: AudioEncoderConfig | None = None
    audio_start: int | None = None
    audio_pad: int | None = None
    audio_end: int | None = None
    #: The thinker layer whose output the talker reads at audio positions (upstream's
    #: ``talker_config.accept_hidden_layer``: hidden state after that many layers). One past
    #: the thinker's layers leaves the talker unable to speak a spoken turn (it says so), as
    #: upstream cannot; text and text-only speech are unaffected.
    accept_hidden_layer: int = 18

    def __post_init__(self) -> None:
        """Raises ValueError: sizes that do not fit together."""
        if self.accept_hidden_layer < 0:
            raise ValueError(f"accept_hidden_layer must be >= 0, got {self.accept_hidden_layer}")
        if self.audio is not None and self.audio.output_dim != self.thinker.hidden_size:
            raise ValueError(
                f"the audio encoder makes {self.audio.output_dim}-wide rows but the thinker is "
                f"{self.thinker.hidden_size} wide"
            )
        if self.code2wav.num_quantizers != self.num_code_groups:
            raise ValueError(
                f"code2wav has {self.code2wav.num_quantizers} quantizers but the talker makes "
                f"{self.num_code_groups} codebooks per frame"
            )
        if self.num_code_groups < 3:
            raise ValueError(f"num_code_groups must be >= 3, got {self.num_code_groups}")
        if not self.speakers:
            raise ValueError("OmniConfig needs at least one speaker")

    @property
    def speaker_ids(self) -> dict[str, int]:
        """Speaker name (lower case) -> codec id."""
        return dict(self.speakers)

    @property
    def codebook_size(self) -> int:
        """Codes per codebook (the code predictor's vocabulary)."""
        return self.code2wav.codebook_size

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> OmniConfig:
        """Read a ``Qwen3OmniMoeForConditionalGeneration`` ``config.json`` dict.

        Raises:
            ValueError: a section or key is missing.
        """
        try:
            thinker = config["thinker_config"]["text_config"]
            talker = config["talker_config"]
            talker_text = talker["text_config"]
            predictor = talker["code_predictor_config"]
            code2wav = config.get("code2wav_config", {})
            audio = config["thinker_config"].get("audio_config")
            thinker_ids = config["thinker_config"]
        except KeyError as missing:
            raise ValueError(f"Qwen3-Omni config.json lacks {missing}") from None
        talker_shape = replace(
            Qwen3Config.from_hf(talker_text),
            shared_expert_intermediate_size=int(
                talker_text.get("shared_expert_intermediate_size", 0) or 0
            ),
        )
        groups = int(talker.get("num_code_groups", 32))
        codec = codec_ids(talker)
        return cls(
            thinker=Qwen3Config.from_hf(thinker),
            talker=talker_shape,
            predictor=Qwen3Config.from_hf(predictor),
            code2wav=Code2WavConfig.from_hf({"num_quantizers": groups, **dict(code2wav)}),
            thinker_vocab=int(thinker["vocab_size"]),
            talker_vocab=int(talker_text["vocab_size"]),
            num_code_groups=groups,
            **codec,
            speakers=lower_names(talker.get("speaker_id")) or (("default", codec["codec_pad"]),),
            tts_bos=config.get("tts_bos_token_id"),
            tts_eos=config.get("tts_eos_token_id"),
            tts_pad=config.get("tts_pad_token_id"),
            audio=None if audio is None else AudioEncoderConfig.from_hf(audio),
            audio_start=thinker_ids.get("audio_start_token_id"),
            audio_pad=thinker_ids.get("audio_token_id"),
            audio_end=thinker_ids.get("audio_end_token_id"),
            accept_hidden_layer=int(talker.get("accept_hidden_layer", 18)),
        )


def _sized(
    *,
    thinker: Qwen3Config,
    talker: Qwen3Config,
    predictor_layers: int,
    codebook: int,
    groups: int,
    code2wav: Code2WavConfig,
    audio: AudioEncoderConfig,
) -> OmniConfig:
    specials = 16
    predictor = replace(
        talker,
        num_hidden_layers=predictor_layers,
        num_experts=0,
        shared_expert_intermediate_size=0,
    )
    return OmniConfig(
        thinker=thinker,
        talker=talker,
        predictor=predictor,
        code2wav=code2wav,
        thinker_vocab=0,  # the tokenizer's vocabulary + 3 tts + 3 audio ids, set by the builder
        talker_vocab=codebook + specials,
        num_code_groups=groups,
        codec_pad=codebook,
        codec_bos=codebook + 1,
        codec_eos=codebook + 2,
        codec_nothink=codebook + 7,
        codec_think_bos=codebook + 8,
        codec_think_eos=codebook + 9,
        speakers=(("ethan", codebook + 10), ("chelsie", codebook + 11)),
        audio=audio,
        accept_hidden_layer=thinker.num_hidden_layers // 2,
    )


_TINY = _sized(
    thinker=Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    talker=Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        shared_expert_intermediate_size=64,
    ),
    predictor_layers=1,
    codebook=64,
    groups=4,
    code2wav=Code2WavConfig(
        codebook_size=64,
        num_quantizers=4,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        decoder_dim=16,
    ),
    audio=AudioEncoderConfig(
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        d_model=32,
        output_dim=64,
        downsample_hidden_size=16,
    ),
)

_SMALL = _sized(
    thinker=Qwen3Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
    ),
    talker=Qwen3Config(
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        norm_topk_prob=False,
        shared_expert_intermediate_size=192,
    ),
    predictor_layers=2,
    codebook=256,
    groups=8,
    code2wav=Code2WavConfig(
        codebook_size=256,
        num_quantizers=8,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        decoder_dim=128,
    ),
    audio=AudioEncoderConfig(
        encoder_layers=4,
        encoder_attention_heads=5,
        encoder_ffn_dim=640,
        d_model=160,
        output_dim=256,
        downsample_hidden_size=60,
    ),
)

#: Seeded sizes by name.
SIZES: dict[str, OmniConfig] = {"tiny": _TINY, "small": _SMALL}
