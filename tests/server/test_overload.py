"""Overload is refused at once with the server healthy; a client leaving cancels its request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import openai
import pytest

from mstar_async.engines import Engine, Step, StepResult
from tests.server.conftest import LIMIT, Live
from tests.server.live import http

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Tell me a long story"}]
#: Generated tokens of a long reply: the tiny model's 256 positions hold the prompt and these.
LONG = 200
DECODE_S = 0.02


class _DecodeGate:
    """Wraps the LM engine: once ``LIMIT`` requests have prefilled, decodes wait (on the
    forward thread, so the whole batching loop waits) until opened. Admitted requests then
    stay in flight exactly as long as the test needs, while the event loop stays free."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.prefilled: set[str] = set()

    def cost(self, step: Step) -> int:
        return self.inner.cost(step)

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        self.prefilled |= {step.request_id for step in steps if step.op == "prefill"}
        if len(self.prefilled) >= LIMIT and any(step.op == "decode" for step in steps):
            assert self.open.wait(60), "the test never opened the gate"
        return self.inner.forward(steps)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)


class _SlowDecode:
    """Wraps the LM engine: every forward with a decode step takes ``DECODE_S`` longer, so a
    request of a few hundred tokens (all the tiny model's positions allow) is still running
    seconds later, when the test leaves it."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner

    def cost(self, step: Step) -> int:
        return self.inner.cost(step)

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        if any(step.op == "decode" for step in steps):
            time.sleep(DECODE_S)
        return self.inner.forward(steps)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)


@contextmanager
def slow_decode(live: Live) -> Iterator[Engine]:
    engines = live.served().runtime.batching.engines
    inner = engines["lm"]
    engines["lm"] = _SlowDecode(inner)
    try:
        yield inner
    finally:
        engines["lm"] = inner


@contextmanager
def decode_gate(live: Live) -> Iterator[_DecodeGate]:
    engines = live.served().runtime.batching.engines
    gate = _DecodeGate(engines["lm"])
    engines["lm"] = gate  # the batching loop looks engines up per forward
    try:
        yield gate
    finally:
        gate.open.set()
        engines["lm"] = gate.inner


def _admitted(live: Live) -> Any:
    # Long enough that the first request cannot finish before the second one prefills (the
    # gate shuts only then), however slowly a loaded machine lets the second one in.
    return live.client.chat.completions.create(
        model="causal-lm",
        messages=MESSAGES,
        max_tokens=LONG,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def _refused_in(live: Live) -> tuple[float, Any]:
    started = time.perf_counter()
    try:
        live.client.chat.completions.create(
            model="causal-lm", messages=MESSAGES, max_tokens=4, stream=True
        )
    except openai.RateLimitError as exc:
        return time.perf_counter() - started, exc
    raise AssertionError(
        f"a request past the in-flight limit was admitted {live.served().admission.in_flight}"
    )


def test_past_the_limit_requests_get_429_at_once_and_admitted_ones_finish(live: Live) -> None:
    with decode_gate(live) as gate:
        with ThreadPoolExecutor(LIMIT) as pool:  # at once: both prefill before the gate shuts
            admitted = list(pool.map(lambda _: _admitted(live), range(LIMIT)))
        firsts = [next(iter(stream)) for stream in admitted]
        assert live.served().admission.in_flight == LIMIT
        with ThreadPoolExecutor(8) as pool:
            refusals = list(pool.map(lambda _: _refused_in(live), range(8)))
        for seconds, exc in refusals:
            assert seconds < 2.0
            assert exc.status_code == 429 and exc.type == "rate_limit_error"
            assert exc.response.headers["retry-after"] == "1"
        health = http("GET", f"{live.url}/health", timeout=5)
        assert health.status == 200
        assert health.json()["models"]["causal-lm"]["in_flight"] == LIMIT
        gate.open.set()
        for first, stream in zip(firsts, admitted, strict=True):
            chunks = [first, *stream]
            assert chunks[-1].choices[0].finish_reason == "length"
            assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert live.served().admission.in_flight == 0
    reply = live.client.chat.completions.create(model="causal-lm", messages=MESSAGES, max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_client_that_leaves_mid_stream_cancels_its_request(live: Live) -> None:
    served = live.served()
    with slow_decode(live) as engine:
        stream = live.client.chat.completions.create(
            model="causal-lm",
            messages=MESSAGES,
            max_tokens=LONG,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        while not next(chunks).choices[0].delta.content:  # past the role chunk, to the text
            pass
        assert engine.blocks_in_use > 0 and len(served.runtime.conductor.active) == 1
        stream.close()
        _wait_freed(live, engine)  # still slow: the request alone would run for seconds more


def test_a_client_that_times_out_on_a_whole_reply_cancels_it_too(live: Live) -> None:
    with slow_decode(live) as engine:
        with pytest.raises(openai.APITimeoutError):
            live.client.with_options(timeout=1.0).chat.completions.create(
                model="causal-lm",
                messages=MESSAGES,
                max_tokens=LONG,
                extra_body={"ignore_eos": True},
            )
        _wait_freed(live, engine)


def _wait_freed(live: Live, engine: Any) -> None:
    served = live.served()
    left = time.perf_counter()
    while engine.blocks_in_use or served.runtime.conductor.active:
        assert time.perf_counter() - left < 3.0, "the request outlived its client"
        time.sleep(0.01)
    assert served.admission.in_flight == 0
