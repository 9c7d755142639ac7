"""Shared test setup.

Ray stays on loopback: see ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` below.

Every async test runs on the default asyncio loop. Those of ``UVLOOP_FOLDERS`` (the transport,
the conductor and the runtime, where the loop's own machinery is exercised: sockets, futures
woken from threads, cancellation) and those marked ``uvloop`` run on uvloop as well; worker
processes always run uvloop, whatever the test's loop. A test that parametrizes
``anyio_backend`` itself keeps its own choice.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Ray, wherever a test starts or joins it, uses 127.0.0.1 for every service rather than this
# host's own address (on Linux it registers the host's address unless this is 0); set before
# anything imports ray, and inherited by every process a test starts (`mstar serve`, workers).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

#: Folders under tests/ whose async tests run on both loops.
UVLOOP_FOLDERS = frozenset({"transport", "conductor", "runtime"})

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
    folder = metafunc.definition.path.parent.name
    both = folder in UVLOOP_FOLDERS or metafunc.definition.get_closest_marker("uvloop") is not None
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
