"""The request program of ``qwen3-tts``: choose the voice, lay out the prompt, speak.

A request speaks ``text`` in one of three kinds of voice, as upstream's three model kinds do:
a named ``speaker`` (CustomVoice), a voice described by ``instruct`` alone (VoiceDesign; an
instruction may also accompany a speaker), or a cloned voice (Base): ``voice`` (a
``VoicePrompt`` computed once, e.g. by the voice registry) or ``ref_audio`` (24 kHz mono PCM,
encoded for this request only) with its ``ref_text``. ``encode_only`` runs just the encoders
and yields the ``VoicePrompt``, which is how a voice is registered.

A registered voice (one with an ``id``) keeps the KV of the prompt rows every request of it
shares (``TalkerPrompt.voice_rows``) under ``voice_handle(id)`` on the talker's rank: the
first request there computes them, later ones fork them and compute only the rest; evictable,
so under memory pressure they go (least recently used first) and the next request computes
them again. The decoder keeps, per rank, its convolutions' state after the voice's reference
frames for the first window. ``forget_voice=<id>`` drops both on every replica (the voice
registry's delete).

Sampling is upstream's: ``temperature`` / ``top_k`` / ``top_p`` and ``repetition_penalty``
(over the codebook-0 codes of the frames spoken so far) for the talker, ``subtalker_*`` for
the code predictor. A value out of range fails the request with ``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import torch

from mstar_async.engines.sampling import SamplingParams
from mstar_async.models.checkpoints import ChatTokenizer
from mstar_async.models.qwen3_omni.talker import REPETITION_PENALTY
from mstar_async.models.qwen3_tts.config import SAMPLE_RATE, TTSConfig
from mstar_async.models.qwen3_tts.prompt import SPEAKER, PromptIds, TalkerPrompt, lay_out
from mstar_async.models.qwen3_tts.voice import VoicePrompt
from mstar_async.outputs import AudioChunk, LatentOutput

__all__ = ["REPETITION_PENALTY", "make_program", "voice_handle"]

_ROLE = "<|im_start|>assistant\n"
_END = "<|im_end|>\n"
#: Frames a request may speak by default: upstream's 12.5 Hz leaves a few frames per token.
_FRAMES_PER_TOKEN = 8
_MAX_DEFAULT_FRAMES = 2048


def voice_handle(voice_id: str) -> str:
    """The talker's KV handle of registered voice ``voice_id``."""
    return f"voice:{voice_id}"


def chat_ids(tokenizer: ChatTokenizer, text: str, tail: str) -> tuple[list[int], list[int]]:
    """``(role ids, text ids)`` of ``<|im_start|>assistant\\n{text}{tail}``, cut as upstream
    cuts its chat string (its fixed ``[:3]`` and ``[3:-5]`` / ``[3:-2]`` are these lengths for
    Qwen's tokenizer; measured here, so other tokenizers cut right too).

    Raises:
        ValueError: the text encodes to no token of its own.
    """
    ids = tokenizer.encode(f"{_ROLE}{text}{tail}")
    head, end = len(tokenizer.encode(_ROLE)), len(tokenizer.encode(tail))
    body = ids[head : len(ids) - end]
    if not body:
        raise ValueError("the text to speak is empty; give at least one word")
    return ids[:head], body


def layout_for(
    tokenizer: ChatTokenizer,
    cfg: TTSConfig,
    ids: PromptIds,
    text: str,
    *,
    speaker: str | None,
    language: str,
    instruct: str,
    voice: VoicePrompt | None,
    streaming_text: bool | None,
) -> TalkerPrompt:
    """The talker's prompt for one request (see ``prompt.lay_out``).

    Raises:
        ValueError: an unknown speaker or language, a speaker together with a cloned voice,
            empty text.
    """
    if voice is not None and speaker:
        raise ValueError("give either a speaker or a cloned voice, not both")
    codec_speaker: int | None = None
    if speaker:
        names = dict(cfg.speakers)
        if speaker.lower() not in names:
            raise ValueError(f"unknown speaker {speaker!r}; speakers: {sorted(names)}")
        codec_speaker = names[speaker.lower()]
    elif voice is not None:
        codec_speaker = SPEAKER
    lang: int | None = None
    if language.lower() != "auto":
        languages = dict(cfg.languages)
        if language.lower() not in languages:
            raise ValueError(
                f"unknown language {language!r}; languages: auto, {', '.join(sorted(languages))}"
            )
        lang = languages[language.lower()]
    role, body = chat_ids(tokenizer, text, _END + _ROLE)
    turn = tokenizer.encode(f"<|im_start|>user\n{instruct}{_END}") if instruct else []
    ref_text = None
    if voice is not None and voice.in_context:
        ref_text = chat_ids(tokenizer, voice.transcript or "", _END)[1]
    # Upstream's defaults: cloned voices take the text streamed, the other kinds whole.
    streamed = (voice is not None) if streaming_text is None else streaming_text
    return lay_out(
        ids,
        role,
        body,
        instruct=turn,
        language=lang,
        speaker=codec_speaker,
        ref_text=ref_text,
        ref_codes=voice.codes if voice is not None else None,
        streaming_text=streamed,
    )


def make_program(
    tokenizer: ChatTokenizer, cfg: TTSConfig, ids: PromptIds, left_context: int
) -> Callable[..., AsyncGenerator[Any, None]]:
    """The model's request program (see the module docstring for its inputs)."""

    async def program(
        request: Any,
        text: str = "",
        speaker: str | None = None,
        language: str = "auto",
        instruct: str = "",
        voice: Any = None,
        ref_audio: torch.Tensor | None = None,
        ref_text: str | None = None,
        x_vector_only: bool = False,
        encode_only: bool = False,
        forget_voice: str = "",
        streaming_text: bool | None = None,
        max_tokens: int = 0,
        seed: int = 0,
        temperature: float = 0.9,
        top_k: int = 50,
        top_p: float = 1.0,
        repetition_penalty: float = REPETITION_PENALTY,
        subtalker_temperature: float = 0.9,
        subtalker_top_k: int = 50,
        subtalker_top_p: float = 1.0,
        return_codes: bool = False,
    ) -> AsyncGenerator[Any, None]:
        if forget_voice:
            # Every talker replica that spoke the voice keeps its own copy.
            await request.run_on_replicas("forget_voice", handle=voice_handle(forget_voice))
            return
        # Checked first: a bad value fails before any audio is encoded.
        talker_sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            repetition_penalty=repetition_penalty,
        )
        predictor_sampling = SamplingParams(
            temperature=subtalker_temperature,
            top_k=subtalker_top_k,
            top_p=subtalker_top_p,
            seed=seed + 1,
        )
        if ref_audio is not None:
            if voice is not None:
                raise ValueError("give either voice or ref_audio, not both")
            if not cfg.can_clone:
                raise ValueError("this checkpoint cannot clone voices (no speaker encoder)")
            if not x_vector_only and not ref_text:
                raise ValueError(
                    "ref_text (what the reference audio says) is required to clone in context;"
                    " or set x_vector_only to use the speaker embedding alone"
                )
            pcm = torch.as_tensor(ref_audio).float().reshape(-1)
            encoded = await request.run(
                "encode_voice", pcm=pcm, with_codes=torch.tensor(not x_vector_only)
            )
            codes = None if x_vector_only else torch.as_tensor(encoded["codes"]).long()
            voice = VoicePrompt(torch.as_tensor(encoded["speaker"]).float(), codes, ref_text)
        if voice is not None and not isinstance(voice, VoicePrompt):
            # A registered voice (the registry's stored tensors) or any object with the same
            # attributes.
            voice = VoicePrompt(
                voice.speaker, voice.codes, voice.transcript, getattr(voice, "id", None)
            )
        if encode_only:
            if voice is None:
                raise ValueError("encode_only needs ref_audio")
            yield voice
            return
        prompt = layout_for(
            tokenizer,
            cfg,
            ids,
            text,
            speaker=speaker,
            language=language,
            instruct=instruct,
            voice=voice,
            streaming_text=streaming_text,
        )
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0: automatic), got {max_tokens}")
        cap = max_tokens or min(
            _MAX_DEFAULT_FRAMES, _FRAMES_PER_TOKEN * (prompt.trailing.numel() + 8)
        )
        embedding = voice.speaker if voice is not None else torch.zeros(0)
        voice_id = voice.id if voice is not None else None
        handle = voice_handle(voice_id) if voice_id else None
        await request.run(
            "prefill",
            layout=prompt.layout,
            speaker=embedding,
            sampling=talker_sampling,
            voice_id=voice_id or "",
            voice_rows=prompt.voice_rows,
            resume=handle,
            keep=handle,
        )
        groups = cfg.num_code_groups
        prime = torch.zeros(0, groups, dtype=torch.long)
        if voice is not None and voice.codes is not None:
            prime = voice.codes[-left_context:].long() if left_context else prime
        async with request.stream(
            "speak",
            params={"max_frames": cap},
            sampling=predictor_sampling,
            trailing=prompt.trailing,
            prime=prime,
            voice=handle or "",
        ) as events:
            async for event in events:
                if event.port == "decoder.pcm":
                    if event.value.numel():
                        yield AudioChunk(event.value, SAMPLE_RATE)
                elif return_codes:
                    yield LatentOutput(event.value, event.iteration)

    return program
