"""BlockCausalKVEngine on the tiny V-JEPA 2-AC predictor: however frames are split over steps,
forwards and token budgets, and whatever shares a forward, each prediction equals the dense
block-causal forward over the whole context."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.engines import WAIT, Step
from mstar_async.errors import EngineError, KVCacheFull
from mstar_async.models.vjepa2 import make_config, random_inputs
from mstar_async.models.vjepa2.engines import predictor_engine, seeded
from mstar_async.models.vjepa2.pose import next_state

pytestmark = pytest.mark.timeout(60)
CFG = make_config("tiny", kv_frames=32)
ENCODER, PREDICTOR = seeded(CFG)
TOLERANCE = 1e-4


class Request:
    """One request's rollout driven by hand: its steps, and the reference predictions."""

    def __init__(self, rid: str, horizon: int, frames: int, seed: int) -> None:
        self.rid = rid
        self.inputs = random_inputs(CFG, horizon, seed, context_frames=frames)
        with torch.inference_mode():
            self.latents = ENCODER(self.inputs.video)
        self.outputs: list[dict[str, Any]] = []

    def next_step(self) -> Step:
        if not self.outputs:
            inputs = {
                "latents": self.latents,
                "context_actions": self.inputs.context_actions,
                "states": self.inputs.states,
                "actions": self.inputs.actions,
            }
            return Step(self.rid, "prefill", inputs)
        last = self.outputs[-1]
        inputs = {
            "latent": last["latent"],
            "state": last["state"],
            "index": last["index"],
            "actions": self.inputs.actions,
        }
        return Step(self.rid, "step", inputs)

    @property
    def done(self) -> bool:
        return len(self.outputs) == self.inputs.horizon

    def check(self) -> None:
        """Each prediction equals the dense forward over the context it was predicted from."""
        with torch.inference_mode():
            latents = self.latents
            actions = torch.cat([self.inputs.context_actions, self.inputs.actions[:1]])
            states = self.inputs.states
            for i, out in enumerate(self.outputs):
                want = PREDICTOR.predict_all(latents, actions, states)[-1]
                torch.testing.assert_close(out["latent"], want, atol=TOLERANCE, rtol=0)
                assert int(out["index"]) == i + 1
                state = next_state(states[-1], self.inputs.actions[i])
                torch.testing.assert_close(out["state"], state)
                latents = torch.cat([latents, out["latent"].unsqueeze(0)])
                states = torch.cat([states, state.unsqueeze(0)])
                actions = torch.cat([actions, self.inputs.actions[i + 1 : i + 2]])


def drive(requests: list[Request], budgets: list[int], engine: Any) -> int:
    """Run all requests to the end, a step of each live request per forward; returns forwards."""
    forwards = 0
    pending = {r.rid: r.next_step() for r in requests}
    while pending:
        steps = list(pending.values())
        for k, step in enumerate(steps):
            step.budget = budgets[(forwards + k) % len(budgets)]
        results = engine.forward(steps)
        forwards += 1
        for step, result in zip(steps, results, strict=True):
            request = next(r for r in requests if r.rid == step.request_id)
            if result is None:
                continue  # a prefill chunked by its budget: the same step comes back
            assert isinstance(result, dict), result
            request.outputs.append(result)
            del pending[step.request_id]
            if not request.done:
                pending[step.request_id] = request.next_step()
            else:
                engine.release(step.request_id)
    return forwards


@settings(max_examples=8, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 3)), min_size=1, max_size=3),
    budgets=st.lists(st.sampled_from([0, 1, 18, 40, 100]), min_size=1, max_size=3),
)
def test_any_batching_and_budget_gives_the_dense_predictions(
    shapes: list[tuple[int, int]], budgets: list[int]
) -> None:
    engine = predictor_engine(CFG)
    requests = [Request(f"r{i}", h, f, seed=i) for i, (h, f) in enumerate(shapes)]
    drive(requests, budgets, engine)
    for request in requests:
        request.check()
    assert engine.frames_in_use == 0
    engine.allocator.check_invariants()


def test_a_budget_splits_a_prefill_into_whole_frames() -> None:
    engine = predictor_engine(CFG)
    request = Request("r", horizon=2, frames=3, seed=1)
    step = request.next_step()
    per_frame = CFG.tokens_per_frame
    assert engine.cost(step) == 3 * per_frame
    step.budget = per_frame + 1  # one whole frame fits
    assert engine.forward([step]) == [None]
    assert engine.frames_held("r") == 1 and engine.cost(step) == 2 * per_frame
    step.budget = 2 * per_frame
    [result] = engine.forward([step])
    assert isinstance(result, dict) and engine.frames_held("r") == 3
    request.outputs.append(result)
    assert engine.cost(request.next_step()) == per_frame


def test_full_cache_waits_impossible_request_fails_and_release_frees() -> None:
    engine = predictor_engine(make_config("tiny", kv_frames=4))
    big = Request("big", horizon=1, frames=3, seed=2)
    small = Request("small", horizon=1, frames=2, seed=3)
    assert isinstance(engine.forward([big.next_step()])[0], dict)
    assert engine.forward([small.next_step()]) == [WAIT]  # 3 + 2 frames > 4
    engine.release("big")
    assert engine.frames_in_use == 0
    huge = Request("huge", horizon=1, frames=5, seed=4)
    [failed] = engine.forward([huge.next_step()])
    assert isinstance(failed, KVCacheFull) and "needs KV for 5 frames" in str(failed)
    assert engine.frames_in_use == 0
    engine.release("huge")
    engine.release("huge")  # idempotent


def _fails_alone(engine: Any, bad: Step, good: Step, reason: str) -> None:
    """A bad step beside a good one: the bad one fails with ``reason``, the good one runs."""
    failed, ran = engine.forward([bad, good])
    assert isinstance(failed, EngineError) and re.search(reason, str(failed)), failed
    assert isinstance(ran, dict), ran
    engine.release(good.request_id)


def test_bad_steps_fail_alone_with_the_reason() -> None:
    engine = predictor_engine(CFG)
    request = Request("r", horizon=2, frames=2, seed=5)
    prefill = request.next_step()
    _fails_alone(engine, Step("x", "decode", {}), prefill, "no op 'decode'")
    later = Request("r2", horizon=2, frames=2, seed=5)
    later.outputs.append({"latent": torch.zeros(16, 32), "state": torch.zeros(7), "index": 1})
    _fails_alone(engine, later.next_step(), prefill, "step before prefill")
    bad = Step("y", "prefill", {**prefill.inputs, "states": torch.zeros(1, 7)})
    _fails_alone(engine, bad, prefill, "2 context frames need 1 context_actions and 2 states")
    with pytest.raises(EngineError, match="two steps of one request"):
        engine.forward([prefill, prefill])
