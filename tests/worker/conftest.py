"""Fixtures of the worker tests: ``mstar worker`` processes that never outlive their test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.joining import Workers


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    started = Workers(tmp_path)
    yield started
    started.stop()
