"""``qwen3-omni``: a Qwen3-Omni-style thinker -> talker (+ code predictor) -> code2wav model.

Graph (engines in brackets)::

    thinker_prefill [thinker] --token--> thinker [thinker]  (DynamicLoop: text decode)
                                            |  stream of each token's embedding row,
                                            |  LeftContextChunkPolicy(1, 0, lookahead=1)
                                            v
    talker_prefill [talker] --> ( predictor_prefill [predictor]
                                  -> Loop(predictor [predictor], G-2)   codebooks 1..G-1
                                  -> talker [talker] )                  DynamicLoop: one frame,
                                            |                           outliving the text
                                            |  stream, LeftContextChunkPolicy(25, 25)
                                            v
                                     code2wav [code2wav] --> PCM

Speech in: ``audio_in [audio]`` (the thinker's audio tower) encodes 16 kHz PCM fed to it as a
streamed walk input (walk ``listen`` while the user talks, ``hear`` for whole audio); its rows
replace the audio placeholders' embeddings in ``thinker_prefill`` (see ``audio_prompt``).

Walks: ``prefill`` (thinker prompt), ``text`` (text-only decode), ``voice`` (talker prompt) and
``speak`` (thinker decode, talker frames and code2wav, pipelined in one ``Sequential``); ``keep``,
``forget``, ``rewind`` and ``rewind_voice`` look after a conversation's KV kept between turns
(the thinker's whole conversation, the talker's user turns); a ``warm`` request prefills a
spoken turn still being spoken, as far as its rows are final, under a second handle that the
turn resumes from when it shares more (``turn_prompt``). The
talker's loop reads the thinker's tokens one per frame and goes on after they end, with
``tts_pad`` rows until codec end-of-speech, so code2wav sees one uninterrupted grid of windows.
The talker gets the thinker's input embedding rows (of the prompt, the first token, each streamed
token and the tts specials) from the thinker's engine, never token ids to look up, so its rank
reads none of the thinker's weights (``thinker_engine``).
The request program yields text deltas as the thinker makes tokens and audio chunks as code2wav
finishes windows, interleaved.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Mapping
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mstar_async.engines import StatelessEngine
from mstar_async.engines.kv.cache import capacity_tokens
from mstar_async.engines.sampling import SamplingParams
from mstar_async.graph import (
    ContextLimit,
    DynamicLoop,
    Edge,
    LoopStep,
    Model,
    Node,
    Parallel,
    Sequential,
    TokenCounter,
    Walk,
    stream,
)
from mstar_async.models.checkpoints import (
    ChatTokenizer,
    IncrementalDecoder,
    read_config,
    smollm2_folder,
)
from mstar_async.models.dtypes import DTYPES
from mstar_async.models.qwen3_omni.audio_engine import AudioInEngine
from mstar_async.models.qwen3_omni.audio_features import SAMPLE_RATE as AUDIO_IN_RATE
from mstar_async.models.qwen3_omni.audio_program import (
    HEAR_CHUNK,
    LISTEN_BUFFER,
    LISTEN_CHUNK,
    encode_audio,
    encoded_rows,
    pieces_of,
    with_turn,
)
from mstar_async.models.qwen3_omni.audio_prompt import (
    AudioTokens,
    audio_rows,
    audio_tokens,
    build_prompt,
    check_audio,
    pcm_piece,
)
from mstar_async.models.qwen3_omni.config import SAMPLE_RATE, SIZES, OmniConfig
from mstar_async.models.qwen3_omni.embeds_engine import EmbedsKVEngine
from mstar_async.models.qwen3_omni.frame_loop import (
    frame_edges,
    frame_loop,
    predictor_nodes,
    stack_engine,
)
from mstar_async.models.qwen3_omni.talker import (
    REPETITION_PENALTY,
    TalkerTokens,
    predictor_ops,
    talker_keys,
    talker_ops,
)
from mstar_async.models.qwen3_omni.thinker_engine import ThinkerEngine
from mstar_async.models.qwen3_omni.turn_prompt import (
    known_prompt,
    placed,
    reply_header,
    warm_prompt,
)
from mstar_async.models.qwen3_omni.weights import OmniWeights
from mstar_async.models.registry import register
from mstar_async.outputs import AudioChunk, LatentOutput, TextDelta
from mstar_async.policies import FixedChunkPolicy, LeftContextChunkPolicy

__all__ = ["CHUNK", "LEFT_CONTEXT", "build_qwen3_omni", "seeded_config", "talker_tokens"]

CHUNK = 25
LEFT_CONTEXT = 25
DEFAULT_KV_CACHE_BYTES = 64 * 2**20
#: The longest utterance a request may carry by default (5 min of speech, 3,900 thinker rows).
MAX_AUDIO_SECONDS = 300.0
#: Upstream's code predictor sampling (``Qwen3OmniMoeForConditionalGeneration.generate``):
#: these whatever the talker's, greedy only when the talker is.
PREDICTOR_TEMPERATURE, PREDICTOR_TOP_K, PREDICTOR_TOP_P = 1.0, 50, 0.8


def _role_id(tokenizer: ChatTokenizer, role: str) -> int:
    ids = tokenizer.encode(f"<|im_start|>{role}")
    if len(ids) < 2:
        raise ValueError(f"the tokenizer cannot encode the chat header for role {role!r}")
    return ids[1]


def talker_tokens(
    cfg: OmniConfig, tokenizer: ChatTokenizer, audio_pad: int | None = None
) -> TalkerTokens:
    """The special ids for ``cfg`` and ``tokenizer`` (tts ids default past the vocabulary;
    ``audio_pad``: the thinker's audio placeholder, None for a model that hears nothing).

    Raises:
        ValueError: the tokenizer has no ``<|im_start|>`` token.
    """
    im_start = tokenizer.token_to_id("<|im_start|>")
    if im_start is None:
        raise ValueError("qwen3-omni needs a ChatML tokenizer (with <|im_start|>)")
    base = tokenizer.vocab_size
    return TalkerTokens(
        codebook_size=cfg.codebook_size,
        codec_eos=cfg.codec_eos,
        codec_pad=cfg.codec_pad,
        codec_bos=cfg.codec_bos,
        codec_nothink=cfg.codec_nothink,
        codec_think_bos=cfg.codec_think_bos,
        codec_think_eos=cfg.codec_think_eos,
        tts_bos=base if cfg.tts_bos is None else cfg.tts_bos,
        tts_eos=base + 1 if cfg.tts_eos is None else cfg.tts_eos,
        tts_pad=base + 2 if cfg.tts_pad is None else cfg.tts_pad,
        im_start=im_start,
        user=_role_id(tokenizer, "user"),
        assistant=_role_id(tokenizer, "assistant"),
        speakers=cfg.speaker_ids,
        audio_pad=audio_pad,
    )


def seeded_config(size: str, seed: int, tokenizer: ChatTokenizer) -> OmniConfig:
    """The seeded model's config: ``size``'s shapes over ``tokenizer``'s vocabulary plus the
    three tts ids and the three audio ids.

    Raises:
        ValueError: an unknown size.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; sizes: {sorted(SIZES)}")
    return replace(SIZES[size], thinker_vocab=tokenizer.vocab_size + 6, seed=seed)


# ------------------------------------------------------------------------------ engines


def _thinker_engine(weights: OmniWeights, tokens: TalkerTokens, kv: int) -> ThinkerEngine:
    cfg = weights.config
    return ThinkerEngine(
        weights.thinker(),
        cfg.thinker.attention_spec(weights.dtype),
        tokens,
        num_layers=cfg.thinker.num_hidden_layers,
        kv_cache_bytes=kv,
        device=weights.device,
    )


def _talker_engine(weights: OmniWeights, tokens: TalkerTokens, kv: int) -> EmbedsKVEngine:
    talker = weights.talker()
    ops = talker_ops(talker, tokens)
    return stack_engine(talker.model, weights.config.talker, ops, kv, weights)


def _predictor_engine(weights: OmniWeights, kv: int) -> EmbedsKVEngine:
    predictor = weights.code_predictor()
    ops = predictor_ops(predictor)
    return stack_engine(predictor.model, weights.config.predictor, ops, kv, weights)


def _code2wav_engine(weights: OmniWeights) -> StatelessEngine:
    return StatelessEngine({"decode": weights.code2wav().decode}, device=weights.device)


def _audio_engine(weights: OmniWeights, max_samples: int) -> AudioInEngine:
    return AudioInEngine(weights.audio_encoder(), max_samples=max_samples, device=weights.device)


# ------------------------------------------------------------------------------ graph


def _text_done(prefix: str) -> Callable[[LoopStep], bool]:
    def until(step: LoopStep) -> bool:
        # The prefill made the first token, so decode makes max_tokens - 1 at most.
        if step.iteration + 2 >= int(step.params["max_tokens"]):
            return True
        return int(step.outputs[f"{prefix}.token"]) in step.params["stop_ids"]

    return until


def _nodes(audio: bool) -> list[Node]:
    heard = [
        Node("audio_in", engine="audio", op="encode", inputs=["pcm"], outputs=["rows", "frames"])
    ]
    return [
        *(heard if audio else []),
        Node(
            "thinker_prefill",
            engine="thinker",
            op="prefill",
            inputs=["tokens", "sampling", "embeds", "embeds_at", "resume"],
            # For the talker: embeds_out, the thinker's rows at the audio placeholders; row,
            # rows, tts: input embeddings of the token, of the prompt, of the tts specials.
            outputs=["token", "embeds_out", "row", "rows", "tts"],
        ),
        # A conversation's KV kept between its turns (see the program's ``session``): the
        # thinker's whole conversation, the talker's user turns.
        Node("thinker_keep", engine="thinker", op="retain", inputs=["handle", "evictable"]),
        Node("thinker_forget", engine="thinker", op="drop", inputs=["handle"], outputs=["dropped"]),
        Node(
            "thinker_rewind",
            engine="thinker",
            op="rewind",
            inputs=["handle", "tokens", "embeds", "embeds_at"],
            outputs=["tokens", "embeds_out"],
        ),
        Node("talker_keep", engine="talker", op="retain", inputs=["handle", "evictable"]),
        Node("talker_forget", engine="talker", op="drop", inputs=["handle"], outputs=["dropped"]),
        Node(
            "talker_rewind",
            engine="talker",
            op="rewind",
            inputs=["handle", "keys"],
            outputs=["tokens"],
        ),
        Node("thinker_text", engine="thinker", op="decode", inputs=["token"], outputs=["token"]),
        Node("thinker", engine="thinker", op="decode", inputs=["token"], outputs=["token", "row"]),
        Node(
            "talker_prefill",
            engine="talker",
            op="prefill",
            inputs=[
                "prompt",
                "rows",
                "first",
                "tts",
                "speaker",
                "audio_hidden",
                "sampling",
                "resume",
            ],
            outputs=["code", "context", "history"],
        ),
        *predictor_nodes(),
        Node(
            "talker",
            engine="talker",
            op="decode",
            inputs=["text", "tts", "code", "codes", "history"],
            outputs=["frame", "code", "context", "history"],
        ),
        Node("code2wav", engine="code2wav", op="decode", inputs=["codes"], outputs=["pcm"]),
    ]


def _edges(chunk: int, left_context: int) -> list[Any]:
    return [
        Edge("thinker_prefill.token", "thinker_text.token"),
        Edge("thinker_prefill.token", "thinker.token"),
        Edge("thinker_prefill.rows", "talker_prefill.rows"),
        Edge("thinker_prefill.row", "talker_prefill.first"),
        Edge("thinker_prefill.tts", "talker_prefill.tts"),
        Edge("thinker_prefill.tts", "talker.tts"),
        *frame_edges(),
        # Codebook 0 of the frames so far, which the talker's repetition penalty reads.
        Edge("talker_prefill.history", "talker.history"),
        # A token's row waits for the next token or the end: upstream's last text row is
        # tts_eos in place of the thinker's last token (see talker_ops).
        stream("thinker.row", "talker.text", LeftContextChunkPolicy(1, 0, lookahead=1)),
        stream("talker.frame", "code2wav.codes", LeftContextChunkPolicy(chunk, left_context)),
    ]


def _audio_walks() -> list[Walk]:
    outputs = ["audio_in.rows", "audio_in.frames"]
    return [
        Walk(
            "listen",
            "audio_in",
            streams={"audio_in.pcm": FixedChunkPolicy(LISTEN_CHUNK)},
            outputs=outputs,
            max_buffer=LISTEN_BUFFER,
        ),
        Walk(
            "hear",
            "audio_in",
            streams={"audio_in.pcm": FixedChunkPolicy(HEAR_CHUNK)},
            outputs=outputs,
            max_buffer=2,
        ),
    ]


def _walks(cfg: OmniConfig, max_iterations: int) -> list[Walk]:
    text = DynamicLoop(
        "thinker_text",
        until=_text_done("thinker_text"),
        max_iterations=max_iterations,
        carry={"thinker_text.token": "thinker_text.token"},
    )
    thinker = DynamicLoop(
        "thinker",
        until=_text_done("thinker"),
        max_iterations=max_iterations,
        carry={"thinker.token": "thinker.token"},
    )
    # The talker speaks on after the text stream ends (tts_pad rows).
    frames = frame_loop(
        cfg.num_code_groups,
        cfg.codec_eos,
        max_iterations,
        carry={"talker.history": "talker.history"},
        outlives_streams=True,
    )
    return [
        *(_audio_walks() if cfg.audio is not None else []),
        Walk(
            "prefill",
            "thinker_prefill",
            outputs=["thinker_prefill.token", "thinker_prefill.embeds_out"],
        ),
        Walk("keep", Parallel("thinker_keep", "talker_keep")),
        Walk(
            "forget",
            Parallel("thinker_forget", "talker_forget"),
            outputs=["thinker_forget.dropped", "talker_forget.dropped"],
        ),
        Walk(
            "rewind",
            "thinker_rewind",
            outputs=["thinker_rewind.tokens", "thinker_rewind.embeds_out"],
        ),
        Walk("rewind_voice", "talker_rewind"),
        Walk("text", text, outputs=["thinker_text.token"]),
        Walk("voice", "talker_prefill", outputs=["talker_prefill.code"]),
        Walk(
            "speak",
            Sequential(thinker, frames, "code2wav"),
            outputs=["thinker.token", "talker.frame", "code2wav.pcm"],
        ),
    ]


# ------------------------------------------------------------------------------ program


async def _speak(
    request: Any,
    params: dict[str, Any],
    sampling: SamplingParams,
    detok: IncrementalDecoder,
    return_codes: bool,
) -> AsyncGenerator[Any, None]:
    """Walk ``speak``: text deltas, frames (with ``return_codes``) and audio as they are made.
    The text's last characters go out when the thinker stops, not when the talker does."""
    text_ends = _text_done("thinker")  # the thinker loop's own stop rule
    async with request.stream("speak", params=params, sampling=sampling) as events:
        async for event in events:
            if event.port == "code2wav.pcm":
                if event.value.numel():
                    yield AudioChunk(event.value, SAMPLE_RATE)
            elif event.port == "talker.frame":
                if return_codes:
                    yield LatentOutput(event.value, event.iteration)
            else:
                token = int(event.value)
                if token not in params["stop_ids"] and (delta := detok.push(token)):
                    yield TextDelta(delta)
                step = LoopStep(event.iteration, {"thinker.token": token}, params)
                if text_ends(step) and (rest := detok.finish()):
                    yield TextDelta(rest)


def _placeholders(cfg: OmniConfig, message: Mapping[str, Any]) -> int:
    """Audio placeholders a message's audio takes, for counting (0 for what is not audio)."""
    audio = message.get("audio")
    if cfg.audio is None or not isinstance(audio, torch.Tensor) or audio.dim() not in (1, 2):
        return 0
    return audio_rows(cfg.audio, audio)


def _counter(cfg: OmniConfig, tokenizer: ChatTokenizer, ids: AudioTokens) -> TokenCounter:
    def count(inputs: Mapping[str, Any]) -> int:
        audio = inputs.get("audio")
        # Streamed speech counts once heard (max_audio_seconds bounds it); whole PCM now.
        whole = audio if isinstance(audio, torch.Tensor) else None
        if audio is not None and whole is None:
            whole = torch.zeros(0, cfg.thinker.hidden_size)
        conversation = with_turn(inputs.get("text", ""), inputs.get("messages"), whole)
        counts = [_placeholders(cfg, m) for m in conversation if m.get("audio") is not None]
        return len(build_prompt(tokenizer, ids, conversation, counts).ids)

    return count


def _context_tokens(cfg: OmniConfig, dtype: torch.dtype, kv_cache_bytes: int) -> int:
    # The thinker holds the prompt and the text; the talker holds the prompt too (and the
    # speech frames, which max_frames bounds apart). No Qwen3Config records a position limit.
    return min(
        capacity_tokens(
            part.attention_spec(dtype),
            num_layers=part.num_hidden_layers,
            kv_cache_bytes=kv_cache_bytes,
        )
        for part in (cfg.thinker, cfg.talker)
    )


async def _heard(
    request: Any,
    cfg: OmniConfig,
    max_samples: int,
    text: str,
    messages: list[dict[str, Any]] | None,
    audio: Any,
) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    """The conversation and its audio parts' encoder rows, in order. Every message's audio is
    checked before any of it is encoded; streamed ``audio`` is encoded as it arrives.

    Raises:
        ValueError: audio the model cannot take (see ``check_audio``).
    """
    width = cfg.thinker.hidden_size
    for message in messages or []:
        check_audio(message, cfg.audio, width, max_samples)
    turn = None
    if audio is not None:
        if cfg.audio is None:
            raise ValueError("this model has no audio encoder; send text only")
        if isinstance(audio, AsyncIterable):
            heard = encode_audio(request, audio, max_samples)
            async with aclosing(heard) as pieces:
                rows = [piece.rows async for piece in pieces if piece.rows.numel()]
            turn = torch.cat(rows)
        else:
            turn = check_audio({"audio": pcm_piece(audio)}, cfg.audio, width, max_samples)
    conversation = with_turn(text, messages, turn)
    parts = [m["audio"] for m in conversation if m.get("audio") is not None]
    rows = []
    for part in parts:
        assert cfg.audio is not None  # check_audio refused audio without an encoder
        rows.append(await encoded_rows(request, part, cfg.audio, max_samples))
    return conversation, rows


def _handle(session: str) -> str:
    """The KV handle (thinker's and talker's) of conversation ``session``."""
    return f"conversation:{session}"


def _warm_handle(session: str) -> str:
    """The KV handle (thinker's and talker's) of conversation ``session``'s next turn,
    prefilled while the user speaks it (``warm``)."""
    return f"warm:{session}"


def _resume(session: str | None) -> tuple[str, str] | None:
    """What a turn of conversation ``session`` resumes from: the conversation as its last
    turn kept it, or the turn's own opening prefilled while it was spoken, whichever shares
    more of the prompt."""
    return (_handle(session), _warm_handle(session)) if session else None


async def _rewind(
    request: Any,
    cfg: OmniConfig,
    tokenizer: ChatTokenizer,
    tokens: TalkerTokens,
    audio_ids: AudioTokens,
    max_samples: int,
    session: str,
    messages: list[dict[str, Any]],
) -> None:
    """Cut what conversation ``session`` keeps (the thinker's, then the talker's) back to
    where ``messages`` departs from it, freeing the rest now: the rule a next turn's
    ``resume`` applies, applied as the conversation changes. Nothing is encoded: a message's
    audio given as PCM rather than rows ends what can be matched.

    Raises:
        ValueError: audio the model cannot take (see ``check_audio``); the template cannot
            render the messages.
    """
    width = cfg.thinker.hidden_size
    parts = [check_audio(m, cfg.audio, width, max_samples) for m in messages]
    audio = [a for a in parts if a is not None]
    laid = known_prompt(tokenizer, audio_ids, cfg.audio, messages, audio)
    # The prompt a next turn would start with: the conversation, then the reply's header,
    # which the thinker does not keep (that next turn has a user turn there first).
    ids = torch.tensor(laid.prompt.ids)
    header = reply_header(laid.prompt.ids, tokens.im_start)
    handle = _handle(session)
    kept = await request.run(
        "rewind", handle=handle, tokens=ids[:header], embeds=laid.embeds, embeds_at=laid.embeds_at
    )
    keys = talker_keys(tokens, ids, kept["embeds_out"])
    await request.run("rewind_voice", handle=handle, keys=keys)


def _program(
    cfg: OmniConfig,
    tokenizer: ChatTokenizer,
    tokens: TalkerTokens,
    audio_ids: AudioTokens,
    max_samples: int,
    deaf: str,
) -> Callable[..., AsyncGenerator[Any, None]]:
    async def program(
        request: Any,
        text: str = "",
        messages: list[dict[str, Any]] | None = None,
        audio: Any = None,
        encode_only: bool = False,
        session: str | None = None,
        end_session: bool = False,
        rewind: bool = False,
        warm: bool = False,
        max_tokens: int = 64,
        speak: bool = True,
        seed: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        speaker: str | None = None,
        voice_temperature: float = 0.9,
        voice_top_k: int = 50,
        repetition_penalty: float = REPETITION_PENALTY,
        max_frames: int = 0,
        ignore_eos: bool = False,
        return_codes: bool = False,
    ) -> AsyncGenerator[Any, None]:
        heard_any = audio is not None or any(m.get("audio") is not None for m in messages or [])
        if heard_any and cfg.audio is None:
            raise ValueError(deaf)
        if encode_only:
            # Only hear: the encoder's rows as the speech arrives (a later request's messages
            # can carry them as {"role": "user", "audio": rows}); whole PCM in 8 s steps.
            if audio is None:
                raise ValueError("encode_only needs audio= (16 kHz PCM)")
            streamed = isinstance(audio, AsyncIterable)
            pieces = audio if streamed else pieces_of(pcm_piece(audio))
            walk = "listen" if streamed else "hear"
            async with aclosing(encode_audio(request, pieces, max_samples, walk=walk)) as heard:
                async for piece in heard:
                    yield piece
            return
        if end_session:
            # The conversation is over: its kept KV goes back to the pool.
            if not session:
                raise ValueError("end_session needs session=<the conversation's name>")
            for handle in _resume(session) or ():
                await request.run("forget", handle=handle)
            return
        if rewind:
            # An earlier item changed (a reply truncated where the user stopped listening):
            # the kept KV past the change goes back to the pool now.
            if not session:
                raise ValueError("rewind needs session=<the conversation's name>")
            await _rewind(
                request, cfg, tokenizer, tokens, audio_ids, max_samples, session, messages or []
            )
            return
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        # Checked before any work: a bad value fails the request naming it.
        voice_params = SamplingParams(
            temperature=voice_temperature,
            top_k=voice_top_k,
            seed=seed,
            repetition_penalty=repetition_penalty,
        )
        voice = (speaker or next(iter(tokens.speakers))).lower()
        if voice not in tokens.speakers:
            raise ValueError(f"unknown speaker {speaker!r}; speakers: {sorted(tokens.speakers)}")
        if warm:
            # The user is still speaking: prefill the turn so far (``warm_prompt``) under the
            # conversation's warm handle, which the turn's response resumes from.
            if not session:
                raise ValueError("warm needs session=<the conversation's name>")
            if not messages:
                # No turn in progress any more (cleared): what was warmed goes back now.
                await request.run("forget", handle=_warm_handle(session))
                return
            width = cfg.thinker.hidden_size
            ids, embeds, embeds_at = warm_prompt(
                tokenizer, audio_ids, cfg.audio, width, max_samples, tokens.im_start, messages
            )
            keep: str | None = _warm_handle(session)
        else:
            conversation, rows = await _heard(request, cfg, max_samples, text, messages, audio)
            prompt = build_prompt(tokenizer, audio_ids, conversation, [r.shape[0] for r in rows])
            ids = torch.tensor(prompt.ids)
            embeds, embeds_at = placed(rows, prompt.audio_at)
            # Kept for the next turn: the thinker's whole conversation, the talker's user turns.
            keep = _handle(session) if session else None
        stop_ids = frozenset() if ignore_eos else tokenizer.eos_token_ids
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            max_tokens=max_tokens,
            stop_token_ids=stop_ids,
        )
        detok = IncrementalDecoder(tokenizer)
        if keep:
            # Evictable: a turn that finds it gone computes the conversation again. The turn
            # starts from the last turn's KV or from what was warmed of it, whichever has more.
            await request.run("keep", handle=keep, evictable=True)
        prefill = await request.run(
            "prefill",
            tokens=ids,
            sampling=sampling,
            embeds=embeds,
            embeds_at=embeds_at,
            resume=_resume(session),
        )

        async def voice_code() -> Any:
            """The talker's prefill (its user turns resumed as the thinker's were): the first
            frame's codebook 0."""
            out = await request.run(
                "voice",
                prompt=ids,
                speaker=tokens.speakers[voice],
                audio_hidden=prefill["embeds_out"],
                sampling=voice_params,
                resume=_resume(session),
            )
            return out["code"]

        if warm:
            if speak:
                await voice_code()
            return  # nothing is said before the turn ends
        first = int(prefill["token"])
        if first in stop_ids:
            return
        if delta := detok.push(first):
            yield TextDelta(delta)
        if max_tokens == 1:
            if tail := detok.finish():
                yield TextDelta(tail)
            return
        # Frames are 80 ms; by default speech may run to eight frames per text token.
        frames_cap = max_frames or 8 * max_tokens
        params = {"max_tokens": max_tokens, "stop_ids": stop_ids, "max_frames": frames_cap}
        code0 = await voice_code() if speak else None
        if code0 is None or int(code0) == tokens.codec_eos:
            async with request.stream("text", params=params) as events:
                async for event in events:
                    token = int(event.value)
                    if token in stop_ids:
                        break
                    if delta := detok.push(token):
                        yield TextDelta(delta)
        else:
            predictor_params = SamplingParams(
                temperature=PREDICTOR_TEMPERATURE if voice_temperature > 0 else 0.0,
                top_k=PREDICTOR_TOP_K,
                top_p=PREDICTOR_TOP_P,
                seed=seed + 1,
            )
            speech = _speak(request, params, predictor_params, detok, return_codes)
            async with aclosing(speech) as outputs:
                async for output in outputs:
                    yield output
            return
        if rest := detok.finish():
            yield TextDelta(rest)

    return program


# ------------------------------------------------------------------------------ builder


@register(
    "qwen3-omni",
    "Qwen3-Omni-style thinker -> talker + code predictor -> code2wav, text and 24 kHz speech",
    required=("text",),
)
def build_qwen3_omni(
    path: str | Path | None = None,
    *,
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    max_iterations: int = 4096,
    chunk: int = CHUNK,
    left_context: int = LEFT_CONTEXT,
    max_audio_seconds: float = MAX_AUDIO_SECONDS,
) -> Model:
    """Build the model: seeded weights of ``size`` (``tiny`` or ``small``) over the SmolLM2
    tokenizer, or, with ``path``, a Qwen3-Omni checkpoint folder (its config, tokenizer and
    weights by upstream names; the vision tower ignored). Requests may carry 16 kHz speech
    (``audio``, or ``"audio"`` in a user message) of at most ``max_audio_seconds`` each.

    The tokenizer loads here; weights load when the engines are built on their worker. A
    request's prompt plus ``max_tokens`` may not pass what the thinker's and the talker's KV
    caches hold (``model.context``).

    Raises:
        ValueError: an unknown ``size`` or ``dtype``; ``kv_cache_bytes`` fits no KV block.
        CheckpointError: the folder lacks a file it needs.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    folder = Path(path) if path is not None else None
    if folder is None:
        tokenizer = ChatTokenizer.from_folder(smollm2_folder())
        cfg = seeded_config(size, seed, tokenizer)
    else:
        tokenizer = ChatTokenizer.from_folder(folder)
        cfg = OmniConfig.from_hf(read_config(folder))
    audio_ids = audio_tokens(cfg.audio_start, cfg.audio_pad, cfg.audio_end, tokenizer)
    if cfg.audio is not None and max(audio_ids.start, audio_ids.pad, audio_ids.end) >= (
        cfg.thinker_vocab
    ):
        # A checkpoint whose audio ids the thinker cannot embed cannot hear: serve it deaf
        # (its audio tower is never loaded) and say why when audio comes.
        deaf = (
            f"this checkpoint's audio token ids ({audio_ids.start}, {audio_ids.pad}, "
            f"{audio_ids.end}) are outside the thinker's vocabulary of {cfg.thinker_vocab}; "
            "fix thinker_config's audio_start_token_id / audio_token_id / audio_end_token_id"
        )
        cfg = replace(cfg, audio=None)
    else:
        deaf = "this model has no audio encoder; send text only"
    tokens = talker_tokens(cfg, tokenizer, audio_ids.pad if cfg.audio is not None else None)
    if max_audio_seconds <= 0:
        raise ValueError(f"max_audio_seconds must be > 0, got {max_audio_seconds}")
    max_samples = int(max_audio_seconds * AUDIO_IN_RATE)
    torch_dtype = DTYPES[dtype]
    # Parts are built on the worker, when (and only if) an engine placed there needs them.
    weights = OmniWeights(cfg, folder, torch_dtype, device)
    return Model(
        "qwen3-omni",
        nodes=_nodes(cfg.audio is not None),
        edges=_edges(chunk, left_context),
        walks=_walks(cfg, max_iterations),
        program=_program(cfg, tokenizer, tokens, audio_ids, max_samples, deaf),
        components={
            **(
                {"audio": functools.partial(_audio_engine, weights, max_samples)}
                if cfg.audio is not None
                else {}
            ),
            "thinker": functools.partial(_thinker_engine, weights, tokens, kv_cache_bytes),
            "talker": functools.partial(_talker_engine, weights, tokens, kv_cache_bytes),
            "predictor": functools.partial(_predictor_engine, weights, kv_cache_bytes // 4),
            "code2wav": functools.partial(_code2wav_engine, weights),
        },
        description=f"qwen3-omni ({'seeded ' + size if folder is None else folder})",
        info={
            "sample_rate": SAMPLE_RATE,
            "voice_input": "speaker",
            "voices": sorted(tokens.speakers),
            # Speech in: 16 kHz PCM (0: the model hears nothing).
            "audio_input_rate": AUDIO_IN_RATE if cfg.audio is not None else 0,
        },
        context=ContextLimit(
            _context_tokens(cfg, torch_dtype, kv_cache_bytes),
            _counter(cfg, tokenizer, audio_ids),
            token_chars=tokenizer.max_token_chars,
        ),
    )
