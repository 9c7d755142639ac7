"""The pi0.5 prompt: the instruction and the robot state written as text, then byte tokens.

pi0.5 puts the proprioceptive state into the language prefix: each dimension (normalised to
[-1, 1]) is discretised into 256 bins and written as a number, in the prompt
``"Task: <instruction>, State: <bins>;\\nAction: "``. The tokens are the prompt's UTF-8 bytes
after a beginning-of-sequence id. Upstream uses PaliGemma's SentencePiece vocabulary; with
seeded weights a learned vocabulary adds a large embedding table and a checkpoint download but
no meaning, while bytes keep the LM small and the prompt length honest (about 3-4 tokens per
state dimension, as digits are with most tokenizers).
"""

from __future__ import annotations

import torch

from mstar_async.models.pi05.config import Pi05Config


def discretize_state(state: torch.Tensor, bins: int = 256) -> list[int]:
    """Bin indices in [0, bins) of a state vector normalised to [-1, 1] (values are clamped)."""
    edges = torch.linspace(-1.0, 1.0, bins + 1)[:-1]
    clamped = state.detach().to(torch.float32).clamp(-1.0, 1.0)
    return [int(i) - 1 for i in torch.bucketize(clamped, edges, right=True).tolist()]


def format_prompt(instruction: str, state: torch.Tensor, bins: int = 256) -> str:
    """The pi0.5 prompt text for ``instruction`` and a [-1, 1]-normalised ``state``."""
    cleaned = instruction.strip().replace("_", " ").replace("\n", " ")
    numbers = " ".join(str(b) for b in discretize_state(state, bins))
    return f"Task: {cleaned}, State: {numbers};\nAction: "


def tokenize(instruction: str, state: torch.Tensor, cfg: Pi05Config) -> torch.Tensor:
    """Token ids (long, 1-D) of the prompt: beginning-of-sequence, then its UTF-8 bytes.

    Raises:
        ValueError: ``state`` is not a vector of ``cfg.state_dim`` values.
    """
    if not isinstance(state, torch.Tensor) or state.dim() != 1 or state.shape[0] != cfg.state_dim:
        got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(
            f"pi05: state must be a vector of {cfg.state_dim} values in [-1, 1], got {got}"
        )
    text = format_prompt(instruction, state, cfg.state_bins)
    return torch.tensor([cfg.bos_id, *text.encode("utf-8")], dtype=torch.long)
