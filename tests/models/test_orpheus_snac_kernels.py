"""The SNAC serving kernels: equal to snac's own decode within stated tolerances, and a window's
samples independent of the windows batched with it."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

from mstar_async.engines import StatelessEngine
from mstar_async.engines.base import Step
from mstar_async.models.orpheus.snac_codec import SNAC_TINY, SnacWindowDecoder, build_snac
from mstar_async.models.orpheus.snac_kernels import snake
from mstar_async.models.orpheus.text import byte_tokenizer, vocab_of
from mstar_async.models.orpheus.vocab import codebooks
from mstar_async.policies import Chunk

VOCAB = vocab_of(byte_tokenizer())
FLOAT32_ATOL = 1e-5  # PCM in [-1, 1]: float rounding of folded weights and reordered sums
BFLOAT16_ATOL = 3e-2  # measured about 1e-2 on the small codec's windows (docs/speech.md)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # These tests compare samples, not speed; two threads on a loaded 2-core machine made them
    # 20x slower (0.9 s against 22 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _snac() -> object:
    return build_snac(SNAC_TINY, 7)


def _frames(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (count, 7), generator=generator).tolist()


def _snac_decode(snac: object, frames: list[list[int]], seed: int) -> torch.Tensor:
    with torch.inference_mode(), torch.random.fork_rng():
        torch.manual_seed(seed)
        audio: torch.Tensor = snac.decode(codebooks(frames))  # type: ignore[attr-defined]
    return audio.reshape(-1)


def _chunk(frames: list[list[int]], start: int, context: int, lookahead: int) -> Chunk:
    tokens = [VOCAB.code_token(code, p) for frame in frames for p, code in enumerate(frame)]
    return Chunk(torch.tensor(tokens), start, context=context, lookahead=lookahead)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_equal_snacs_own_decode_within_the_dtypes_tolerance(dtype: torch.dtype) -> None:
    snac = _snac()
    decoder = SnacWindowDecoder(snac, VOCAB, dtype)
    atol = FLOAT32_ATOL if dtype == torch.float32 else BFLOAT16_ATOL
    for count, seed in [(4, 0), (3, 21), (2, 700)]:
        frames = _frames(count, seed)
        reference = _snac_decode(snac, frames, seed)
        pcm = decoder.decode_frames(frames, seed)
        assert pcm.dtype == torch.float32 and pcm.numel() == count * 2048
        torch.testing.assert_close(pcm, reference, rtol=0, atol=atol)


@pytest.mark.timeout(30)
def test_windows_of_several_streams_batched_equal_each_decoded_alone() -> None:
    decoder = SnacWindowDecoder(_snac(), VOCAB)
    # Steady-state windows of three streams (4 frames), a first window (3 frames, nothing
    # before) and a last one (2 frames): three shapes in one call.
    chunks = [_chunk(_frames(4, s), 7 * s, 7, 14) for s in (1, 2, 3)]
    chunks += [_chunk(_frames(3, 4), 0, 0, 14), _chunk(_frames(2, 5), 350, 7, 0)]
    alone = [decoder.window_pcm(chunk) for chunk in chunks]
    assert [a.numel() for a in alone] == [2048] * 5
    decoder.kernels.max_elements = 1 << 12  # slice the batch early, as wide codecs do
    for batched in (decoder.windows_pcm(chunks), decoder.windows_pcm(chunks[::-1])[::-1]):
        for one, many in zip(alone, batched, strict=True):
            torch.testing.assert_close(many, one, rtol=0, atol=1e-6)
    # Through the engine, as the scheduler batches steps of several requests.
    engine = StatelessEngine({"decode": decoder})
    results = engine.forward([Step(f"r{i}", "decode", {"codes": c}) for i, c in enumerate(chunks)])
    for one, result in zip(alone, results, strict=True):
        assert isinstance(result, dict)
        torch.testing.assert_close(result["pcm"], one, rtol=0, atol=1e-6)


def test_snake_matches_the_textbook_form() -> None:
    x = torch.randn(2, 5, 300) * 4
    alpha = torch.rand(1, 5, 1) + 0.1
    textbook = x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
    assert torch.equal(snake(x, alpha, (alpha + 1e-9).reciprocal()), textbook)
