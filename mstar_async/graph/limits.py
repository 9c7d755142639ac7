"""``ContextLimit``: how long one request of a model may be, known before it runs.

A model's sequence can never hold more tokens than its position limit or its whole KV cache;
a request whose prompt plus the tokens it asks to generate passes that can never finish. The
model declares the limit and how to count a request's prompt, so a server can refuse such a
request at once instead of admitting it to fail (or wait) later.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: Counts the prompt tokens a request's program inputs make, as the program encodes them.
TokenCounter = Callable[[Mapping[str, Any]], int]


@dataclass(frozen=True)
class ContextLimit:
    """The most tokens one request holds, and how to count a request's prompt.

    ``tokens``: the prompt plus the generated tokens of one request never exceed it (the
    smaller of the model's position limit and what its KV cache holds in all). ``count``: the
    prompt tokens of a request's program inputs (the inputs it omits take the program's
    defaults); it raises ``ValueError`` or ``TypeError`` for inputs it cannot encode.
    ``generates``: the program input bounding how many tokens a request generates (None: the
    model generates no tokens past its prompt). ``token_chars``: the most characters one token
    of the model's tokenizer can stand for (None: unknown), so a prompt of more characters than
    ``tokens * token_chars`` is known to be too long without counting it.

    Raises:
        ValueError: ``tokens`` is below 1.
    """

    tokens: int
    count: TokenCounter
    generates: str | None = "max_tokens"
    token_chars: int | None = None

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"a context limit must be >= 1 token, got {self.tokens}")
