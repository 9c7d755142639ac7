"""qwen3-omni conversations (``session``): a turn reuses the thinker KV its previous turn kept,
computing only the new tokens, and answers exactly as a request that prefills the whole
conversation; a truncated or edited earlier turn rolls the kept KV back to where it changed,
at the next turn or at once (``rewind``); the talker keeps the user turns' KV the same way;
``end_session`` frees it."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from mstar_async.models import build_model
from mstar_async.models.checkpoints import ChatTokenizer, smollm2_folder
from mstar_async.models.qwen3_omni.audio_prompt import audio_tokens, build_prompt
from mstar_async.models.qwen3_omni.config import SIZES
from mstar_async.outputs import AudioChunk, LatentOutput, TextDelta
from mstar_async.runtime import open_runtime

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


async def _say(runtime: Any, messages: list[dict[str, Any]], **inputs: Any) -> str:
    given = {"max_tokens": 6, "speak": False, "ignore_eos": True, **inputs}
    with anyio.fail_after(60):
        async with runtime.generate(messages=messages, **given) as outputs:
            items = [o async for o in outputs]
    if given["speak"]:
        assert any(isinstance(o, AudioChunk) for o in items)
    return "".join(o.text for o in items if isinstance(o, TextDelta))


async def test_a_turn_reuses_the_last_turns_kv_and_answers_as_a_whole_prefill() -> None:
    async with open_runtime(build_model("qwen3-omni")) as runtime:
        thinker = runtime.batching.engines["thinker"]
        conversation: list[dict[str, Any]] = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about the sea."},
        ]
        first = await _say(runtime, conversation, session="s1")
        (kind, kept, _) = thinker.handles["conversation:s1"]
        assert kind == "prefix" and kept > 0
        conversation += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "And the sky?"},
        ]
        before = thinker.reused_tokens
        second = await _say(runtime, conversation, session="s1")
        reused = thinker.reused_tokens - before
        whole = await _say(runtime, conversation)  # no session: the whole prompt computed
        assert second == whole
        # Everything the first turn computed that the second prompt repeats was reused: its
        # prompt and the reply's tokens (re-encoded from the reply's text), all but the last.
        assert kept - 2 <= reused <= kept
        # An earlier turn changed (a reply cut where the user stopped listening): the kept KV
        # is used up to the cut, no further, and the answer is still a whole prefill's.
        conversation[2]["content"] = first[: len(first) // 2]
        before = thinker.reused_tokens
        third = await _say(runtime, conversation, session="s1")
        assert third == await _say(runtime, conversation)
        assert 0 < thinker.reused_tokens - before < kept
        async with runtime.generate(session="s1", end_session=True) as outputs:
            assert [o async for o in outputs] == []
        assert "conversation:s1" not in thinker.handles
        assert runtime.batching.kv_blocks_in_use == 0


async def test_a_spoken_turn_is_reused_by_the_next_turn() -> None:
    t = torch.arange(16_000) / 16_000
    pcm = 0.3 * torch.sin(2 * torch.pi * 220 * t)
    async with open_runtime(build_model("qwen3-omni")) as runtime:
        thinker = runtime.batching.engines["thinker"]
        async with runtime.generate(audio=pcm, encode_only=True) as outputs:
            rows = torch.cat([o.rows async for o in outputs])
        conversation: list[dict[str, Any]] = [{"role": "user", "content": "", "audio": rows}]
        first = await _say(runtime, conversation, session="s2")
        conversation += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Why?"},
        ]
        before = thinker.reused_tokens
        # Spoken: the talker reads the audio positions through the thinker's hidden rows,
        # which the kept conversation holds for the rows it reuses.
        second = await _say(runtime, conversation, session="s2", speak=True, max_frames=4)
        # The audio's 13 rows are part of what was reused.
        assert thinker.reused_tokens - before > rows.shape[0]
        assert second == await _say(runtime, conversation)
        # Other audio at the same placeholders is not the same conversation.
        other = [{"role": "user", "content": "", "audio": rows.flip(0)}, *conversation[1:]]
        before = thinker.reused_tokens
        assert await _say(runtime, other, session="s2") == await _say(runtime, other)
        # Reused: exactly the tokens before the first audio row (the template's header).
        tokenizer = ChatTokenizer.from_folder(smollm2_folder())
        ids = audio_tokens(None, None, None, tokenizer)
        prompt = build_prompt(tokenizer, ids, other, [rows.shape[0]])
        assert thinker.reused_tokens - before == prompt.audio_at[0]
        async with runtime.generate(session="s2", end_session=True) as outputs:
            [o async for o in outputs]
        assert runtime.batching.kv_blocks_in_use == 0


async def _spoken(runtime: Any, messages: list[dict[str, Any]], **inputs: Any) -> list[list[int]]:
    """The codec frames of a greedy spoken reply (talker and code predictor greedy too)."""
    given = {"max_tokens": 6, "ignore_eos": True, "max_frames": 6, "voice_temperature": 0.0}
    with anyio.fail_after(60):
        async with runtime.generate(messages=messages, return_codes=True, **given, **inputs) as out:
            return [o.latent.tolist() async for o in out if isinstance(o, LatentOutput)]


def _user_rows(conversation: list[dict[str, Any]], audio: int = 0) -> int:
    """Rows of the user turns in the talker's prompt for ``conversation`` (upstream's user
    parts: each user turn from its ``<|im_start|>`` to the next), with ``audio`` pads."""
    tokenizer = ChatTokenizer.from_folder(smollm2_folder())
    ids = audio_tokens(None, None, None, tokenizer)
    counts = [audio] * sum(m.get("audio") is not None for m in conversation)
    prompt = build_prompt(tokenizer, ids, conversation, counts).ids
    start, user = tokenizer.token_to_id("<|im_start|>"), tokenizer.encode("<|im_start|>user")[1]
    turns = [i for i, t in enumerate(prompt) if t == start]
    ends = [*turns[1:], len(prompt)]
    return sum(e - s for s, e in zip(turns, ends, strict=True) if prompt[s + 1] == user)


async def test_the_talker_keeps_the_user_turns_and_speaks_as_a_whole_prefill() -> None:
    t = torch.arange(16_000) / 16_000
    pcm = 0.3 * torch.sin(2 * torch.pi * 220 * t)
    async with open_runtime(build_model("qwen3-omni")) as runtime:
        talker = runtime.batching.engines["talker"]
        async with runtime.generate(audio=pcm, encode_only=True) as outputs:
            rows = torch.cat([o.rows async for o in outputs])
        conversation: list[dict[str, Any]] = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Listen.", "audio": rows},
        ]
        await _spoken(runtime, conversation, session="s3")
        # Upstream's talker reads every user turn, then the new reply's header: the user
        # turns lead its prompt and are what the conversation keeps of it.
        (kind, kept, _) = talker.handles["conversation:s3"]
        assert kind == "prefix" and kept == _user_rows(conversation, rows.shape[0])
        conversation += [
            {"role": "assistant", "content": await _say(runtime, conversation)},
            {"role": "user", "content": "And the sky?"},
        ]
        before = talker.reused_tokens
        frames = await _spoken(runtime, conversation, session="s3")
        # Every kept row was reused, the audio's 13 (matched by the thinker's rows there)
        # included, and the frames are those of a talker that prefilled everything.
        assert talker.reused_tokens - before == kept
        assert frames and frames == await _spoken(runtime, conversation)
        assert talker.handles["conversation:s3"][1] == _user_rows(conversation, rows.shape[0])
        async with runtime.generate(session="s3", end_session=True) as outputs:
            [o async for o in outputs]
        assert talker.handles == {} and runtime.batching.kv_blocks_in_use == 0


async def test_rewind_frees_what_a_cut_reply_kept_at_once_and_answers_as_a_fresh_session() -> None:
    async with open_runtime(build_model("qwen3-omni")) as runtime:
        thinker, talker = (runtime.batching.engines[n] for n in ("thinker", "talker"))
        conversation: list[dict[str, Any]] = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about the sea."},
        ]
        reply = await _say(runtime, conversation, session="s4", max_tokens=64, speak=True)
        conversation.append({"role": "assistant", "content": reply})
        kept = thinker.handles["conversation:s4"][1]
        voice = talker.handles["conversation:s4"]
        blocks = runtime.batching.kv_blocks_in_use
        # The user heard a quarter of the reply: the conversation is cut there, and what the
        # thinker kept past the cut goes back to the pool as the conversation changes.
        conversation[-1]["content"] = reply[: len(reply) // 4]
        async with runtime.generate(messages=conversation, session="s4", rewind=True) as out:
            assert [o async for o in out] == []
        rewound = thinker.handles["conversation:s4"][1]
        assert 0 < rewound < kept - 32
        freed = blocks - runtime.batching.kv_blocks_in_use
        assert freed == -(-kept // 16) - -(-rewound // 16) >= 2
        # The reply is no user turn: the talker's kept user turns stay as they were.
        assert talker.handles["conversation:s4"] == voice
        # The next turn starts from exactly what the rewind kept, and answers as a session
        # that never saw the uncut reply.
        conversation.append({"role": "user", "content": "And the sky?"})
        before = thinker.reused_tokens
        answer = await _say(runtime, conversation, session="s4")
        assert thinker.reused_tokens - before == rewound
        assert answer == await _say(runtime, conversation, session="s5")
        # A user turn deleted: the talker's kept rows go back to before it, at once.
        async with runtime.generate(messages=conversation[:1], session="s4", rewind=True) as out:
            [o async for o in out]
        assert talker.handles["conversation:s4"][1] == 0
        assert thinker.handles["conversation:s4"][1] < rewound
        for name in ("s4", "s5"):
            async with runtime.generate(session=name, end_session=True) as out:
                [o async for o in out]
        assert runtime.batching.kv_blocks_in_use == 0


def _spoken_turn(rows: torch.Tensor) -> dict[str, Any]:
    return {"role": "user", "content": "", "audio": rows}


async def _warm(runtime: Any, messages: list[dict[str, Any]], session: str) -> None:
    """Prefill ``messages`` (the turn being spoken last) under the session's warm handle."""
    with anyio.fail_after(60):
        async with runtime.generate(messages=messages, session=session, warm=True) as outputs:
            assert [o async for o in outputs] == []


async def _answer(runtime: Any, messages: list[dict[str, Any]], **inputs: Any) -> tuple[Any, ...]:
    """A seeded spoken reply (thinker and talker sampling): its text and codec frames."""
    given = {"max_tokens": 6, "ignore_eos": True, "max_frames": 6, "temperature": 0.8}
    with anyio.fail_after(60):
        async with runtime.generate(
            messages=messages, return_codes=True, seed=7, **given, **inputs
        ) as out:
            items = [o async for o in out]
    text = "".join(o.text for o in items if isinstance(o, TextDelta))
    frames = [o.latent.tolist() for o in items if isinstance(o, LatentOutput)]
    assert text and frames
    return text, frames


async def test_a_turn_warmed_while_spoken_computes_only_its_tail_and_answers_the_same() -> None:
    width = SIZES["tiny"].thinker.hidden_size
    rows = torch.randn(39, width, generator=torch.Generator().manual_seed(5))
    heard = 26  # rows of the turn's finished encoder windows when it was warmed
    tokenizer = ChatTokenizer.from_folder(smollm2_folder())
    async with open_runtime(build_model("qwen3-omni")) as runtime:
        thinker, talker = (runtime.batching.engines[n] for n in ("thinker", "talker"))
        conversation: list[dict[str, Any]] = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about the sea."},
        ]
        for session in ("cold", "warm"):  # spoken: the talker keeps the user turn too
            reply = await _say(runtime, conversation, session=session, speak=True, max_frames=4)
        conversation.append({"role": "assistant", "content": reply})
        final = [*conversation, _spoken_turn(rows)]
        prompt = build_prompt(tokenizer, audio_tokens(None, None, None, tokenizer), final, [39])
        turn_at = prompt.audio_at[-1]  # the turn's first audio row
        im_start = tokenizer.token_to_id("<|im_start|>")
        opening = turn_at - max(i for i, t in enumerate(prompt.ids[:turn_at]) if t == im_start)
        reused = {}
        for session in ("cold", "warm"):
            if session == "warm":
                await _warm(runtime, [*conversation, _spoken_turn(rows[:heard])], session)
                assert "warm:warm" in thinker.handles and "warm:warm" in talker.handles
            before = thinker.reused_tokens, talker.reused_tokens
            answer = await _answer(runtime, final, session=session)
            reused[session] = (thinker.reused_tokens - before[0], talker.reused_tokens - before[1])
            reused[session + " answer"] = answer
        # The warmed turn: the thinker took everything up to the last row heard from the warm
        # handle; the cold one only the conversation its last turn kept (the new turn's header
        # and rows computed at the response).
        assert reused["warm"][0] == turn_at + heard
        assert reused["cold"][0] < turn_at
        # The talker likewise: the turn's opening and its 26 rows more than the cold turn.
        assert reused["warm"][1] - reused["cold"][1] == opening + heard
        # And the answer is the same, tokens and frames, as without the warm and as a request
        # that prefills everything.
        whole = await _answer(runtime, final)
        assert reused["warm answer"] == reused["cold answer"] == whole
        for session in ("cold", "warm"):
            async with runtime.generate(session=session, end_session=True) as outputs:
                [o async for o in outputs]
        assert thinker.handles == {} and talker.handles == {}
        assert runtime.batching.kv_blocks_in_use == 0


async def test_a_cleared_warm_leaves_no_handle_and_no_blocks() -> None:
    width = SIZES["tiny"].thinker.hidden_size
    rows = torch.randn(13, width, generator=torch.Generator().manual_seed(6))
    async with open_runtime(build_model("qwen3-omni")) as runtime:
        engines = [runtime.batching.engines[n] for n in ("thinker", "talker")]
        conversation = [{"role": "system", "content": "Be brief."}, _spoken_turn(rows)]
        await _warm(runtime, conversation, "c")
        assert all("warm:c" in e.handles for e in engines) and runtime.batching.kv_blocks_in_use
        # Nothing left to warm (the turn was cleared): the warm handle goes, and its blocks.
        async with runtime.generate(session="c", warm=True) as outputs:
            assert [o async for o in outputs] == []
        assert all(e.handles == {} for e in engines)
        assert runtime.batching.kv_blocks_in_use == 0
