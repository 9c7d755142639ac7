"""A bound on the requests one model serves at once: admit now or refuse now, never queue."""

from __future__ import annotations


class Ticket:
    """One admitted request's place; ``release`` gives it back (idempotent)."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        """Give the place back; later calls do nothing."""
        if self._admission is not None:
            self._admission.in_flight -= 1
            self._admission = None


class Admission:
    """Counts in-flight requests and refuses the one past ``limit``.

    Refusing instead of queueing keeps latency bounded under overload: the client sees a 429
    with Retry-After at once and may retry, and admitted requests keep their pace. Used from
    one event loop only (no locking needed).

    Raises:
        ValueError: ``limit`` is below 1.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the in-flight limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0

    @property
    def full(self) -> bool:
        """Whether ``limit`` requests are in flight (the next is refused)."""
        return self.in_flight >= self.limit

    def try_enter(self) -> Ticket | None:
        """A ticket if fewer than ``limit`` requests are in flight, else None."""
        if self.full:
            return None
        self.in_flight += 1
        return Ticket(self)
