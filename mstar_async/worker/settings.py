"""``RuntimeSettings``: the limits every rank's batching loop runs under, given once.

``open_runtime(settings=...)`` hands the same object to the loop in this process and, through
each worker's configuration, to every worker rank, so a limit set once holds everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeSettings:
    """Limits of one forward and of the CPU share, for every rank.

    ``max_batch_size`` steps and ``max_batch_tokens`` tokens at most in one forward of an
    engine; ``forward_time_bound_s``: a long prefill is cut into chunks whose forward stays
    under it (see ``ForwardTimer``); ``threads``: each worker rank's torch threads (None: the
    cores shared out between the ranks and the conductor's process; a Ray rank takes its CPU
    count). A KV cache's size is the model's own option (``build_model(...,
    kv_cache_bytes=...)``), which every rank rebuilds from the same source.

    Raises:
        ValueError: a limit below 1, a bound not above 0.
    """

    max_batch_size: int = 256
    max_batch_tokens: int = 512
    forward_time_bound_s: float = 0.1
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_batch_tokens < 1:
            raise ValueError(
                "max_batch_size and max_batch_tokens must be >= 1, got "
                f"{self.max_batch_size} and {self.max_batch_tokens}"
            )
        if not self.forward_time_bound_s > 0:
            raise ValueError(f"forward_time_bound_s must be > 0, got {self.forward_time_bound_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")
