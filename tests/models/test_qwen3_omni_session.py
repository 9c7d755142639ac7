"""qwen3-omni conversations (``session``): a turn reuses the thinker KV its previous turn kept,
computing only the new tokens, and answers exactly as a request that prefills the whole
conversation; a truncated or edited earlier turn rolls the kept KV back to where it changed;
``end_session`` frees it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch

from mstar_async.models import build_model
from mstar_async.models.checkpoints import ChatTokenizer, smollm2_folder
from mstar_async.models.qwen3_omni.audio_prompt import audio_tokens, build_prompt
from mstar_async.outputs import AudioChunk, TextDelta
from mstar_async.runtime import open_runtime

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
