"""Shared test setup: every async test runs on the default asyncio loop and on uvloop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
]


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder holding a tiny random Llama and a small byte-level BPE tokenizer."""
    from tests.checkpoints.tiny import (
        CHATML_TEMPLATE,
        make_llama,
        train_tokenizer,
        write_hf_folder,
    )

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = train_tokenizer("gpt2")
    model = make_llama(tokenizer.get_vocab_size(), tied=False, seed=3)
    eos = tokenizer.token_to_id("<|im_end|>")
    write_hf_folder(folder, model, tokenizer, chat_template=CHATML_TEMPLATE, eos_ids=[eos])
    return folder


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test: tiny models on a shared 2-core machine run several
    times faster so, and the thread count is restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
