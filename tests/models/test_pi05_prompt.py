"""The pi0.5 prompt: state bins and byte tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.errors import MstarError
from mstar_async.models.pi05.config import TINY, make_config
from mstar_async.models.pi05.prompt import discretize_state, format_prompt, tokenize

pytestmark = pytest.mark.timeout(30)


def test_state_bins_follow_256_equal_bins_over_minus_one_to_one() -> None:
    state = torch.tensor([-1.0, -0.999, 0.0, 0.004, 0.999, 1.0, 3.0, -3.0])
    assert discretize_state(state) == [0, 0, 128, 128, 255, 255, 255, 0]


@given(st.lists(st.floats(-1.0, 1.0, allow_nan=False, width=32), min_size=1, max_size=16))
def test_every_value_falls_in_its_bin(values: list[float]) -> None:
    for value, b in zip(values, discretize_state(torch.tensor(values)), strict=True):
        assert 0 <= b <= 255
        assert -1 + b * (2 / 256) <= value + 1e-6
        assert b == 255 or value < -1 + (b + 1) * (2 / 256) + 1e-6


def test_prompt_text_and_tokens() -> None:
    state = torch.tensor([0.1, -0.5, 1.0, -1.0])
    text = format_prompt("pick_up the\ncup ", state)
    assert text == "Task: pick up the cup, State: 140 64 255 0;\nAction: "
    tokens = tokenize("pick_up the\ncup ", state, TINY)
    assert tokens[0] == TINY.bos_id and bytes(tokens[1:].tolist()).decode() == text


def test_bad_state_and_config_are_named() -> None:
    with pytest.raises(ValueError, match="state must be a vector of 4 values"):
        tokenize("x", torch.zeros(2, 2), TINY)
    with pytest.raises(MstarError, match="size must be one of"):
        make_config("huge")
    with pytest.raises(MstarError, match="fields:"):
        make_config("tiny", horizon=3)
