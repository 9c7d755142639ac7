"""Shared test setup.

Every async test runs on the default asyncio loop; those marked ``uvloop`` (the transport,
the conductor, the runtime and the worker processes, where the loop's own machinery is
exercised) run on uvloop as well. A test that parametrizes ``anyio_backend`` itself keeps
its own choice.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
]


def _parametrizes_loop(metafunc: pytest.Metafunc) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        if "anyio_backend" in (names.split(",") if isinstance(names, str) else names):
            return True
    return False


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    # Replaced by pytest_generate_tests' parameter; without params here, anyio's own
    # fixture's parametrization (every installed backend) does not apply.
    return LOOPS[0].values[0]  # type: ignore[no-any-return]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "anyio_backend" not in metafunc.fixturenames or _parametrizes_loop(metafunc):
        return
    both = metafunc.definition.get_closest_marker("uvloop") is not None
    metafunc.parametrize("anyio_backend", LOOPS if both else LOOPS[:1])


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
