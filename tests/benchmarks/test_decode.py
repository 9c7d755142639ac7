"""The decode benchmark, run end to end on the tiny random checkpoint (never SmolLM2 here).

No timing is asserted: only that the report has every system (the runtime in one worker
process included), configuration, ratio and aim, the torch threads each system used, and that
every system generated exactly the tokens it was asked for, counted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar_async.bench.decode import (
    AIMS,
    RATIOS,
    SYSTEMS,
    BenchmarkError,
    DecodeConfig,
    Measurement,
    build_prompts,
    check_tokens,
    format_report,
    kv_cache_bytes_for,
    preset,
)
from mstar_async.models.causal_lm import DEFAULT_KV_CACHE_BYTES
from mstar_async.models.checkpoints import ChatTokenizer
from tests.benchmarks.runs import (
    DECODE_CONCURRENCY,
    DECODE_NEW_TOKENS,
    DECODE_REPEAT,
    DECODE_TRANSFORMERS_REQUESTS,
    BenchRun,
)

CONCURRENCY = DECODE_CONCURRENCY
NEW_TOKENS = DECODE_NEW_TOKENS
REPEAT = DECODE_REPEAT
TRANSFORMERS_REQUESTS = DECODE_TRANSFORMERS_REQUESTS


def timed_requests(name: str, concurrency: int) -> int:
    """How many of ``concurrency`` requests the system ``name`` runs and times."""
    return min(concurrency, TRANSFORMERS_REQUESTS) if name == "transformers" else concurrency


@pytest.fixture(scope="module")
def report(decode_run: BenchRun) -> dict[str, Any]:
    """One run through the CLI, as a user types it: JSON on stdout and nothing else there."""
    assert "warming up runtime" in decode_run.progress  # progress goes to stderr
    assert "warming up one-worker" in decode_run.progress
    return decode_run.report


def test_report_has_every_system_configuration_and_ratio(report: dict[str, Any]) -> None:
    assert report["benchmark"] == "decode"
    assert [s["name"] for s in report["systems"]] == list(SYSTEMS)
    for key in ("cpu_model", "torch_version", "torch_threads", "transformers_version"):
        assert report["machine"][key]
    assert report["workload"]["new_tokens"] == NEW_TOKENS
    assert report["workload"]["transformers_requests"] == TRANSFORMERS_REQUESTS
    configurations = {(r["dtype"], r["concurrency"]) for r in report["results"]}
    assert configurations == {("bfloat16", n) for n in CONCURRENCY}
    for entry in report["results"]:
        n = entry["concurrency"]
        assert set(entry["systems"]) == set(SYSTEMS)
        assert set(entry["ratios"]) == {f"{a}/{b}" for a, b in RATIOS}
        for ratio in entry["ratios"].values():
            assert ratio["n"] == REPEAT and 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
        for name in SYSTEMS:
            system = entry["systems"][name]
            assert system["tokens_per_s"]["n"] == REPEAT
            assert system["tokens_per_s"]["median"] > 0
            assert len(system["repetitions"]) == REPEAT
            assert system["extrapolated"] is (timed_requests(name, n) < n)
        assert entry["discarded_repetitions"] == 0  # --retries 0
        assert entry["contaminated_repetitions"] >= 0
        assert entry["systems"]["runtime"]["ttft_ms_p50"]["median"] > 0
        assert entry["systems"]["handloop"]["itl_ms_p50"]["median"] > 0


def test_one_worker_row_is_measured_beside_the_in_process_runtime(report: dict[str, Any]) -> None:
    assert "one-worker" in SYSTEMS and ("one-worker", "runtime") in RATIOS
    for entry in report["results"]:
        worker = entry["systems"]["one-worker"]
        assert worker["tokens_per_s"]["min"] > 0
        assert worker["ttft_ms_p50"]["median"] > 0
        assert worker["itl_ms_p50"]["median"] > 0
        # No engine in this process to count forwards in; tokens come from the outputs.
        assert worker["forwards"] is None and worker["engine_busy"] is None
        ratio = entry["ratios"]["one-worker/runtime"]
        assert ratio["n"] == REPEAT and ratio["min"] > 0


def test_every_system_ran_with_the_same_torch_threads(report: dict[str, Any]) -> None:
    threads = {s["name"]: s["torch_threads"] for s in report["systems"]}
    (worker,) = [s for s in report["systems"] if s["name"] == "one-worker"]
    # The worker rank gets what torch has in this process, as every in-process system does.
    assert set(threads.values()) == {torch.get_num_threads(), worker["conductor_torch_threads"]}
    text = format_report(report)
    assert f"one-worker {torch.get_num_threads()} in its worker process" in text


def test_every_system_generated_exactly_timed_requests_times_new_tokens(
    report: dict[str, Any],
) -> None:
    for entry in report["results"]:
        for name in SYSTEMS:
            timed = timed_requests(name, entry["concurrency"])
            expected = timed * NEW_TOKENS
            for run in entry["systems"][name]["repetitions"]:
                assert run["foreign_cores"] is None or run["foreign_cores"] >= 0
                assert run["timed_requests"] == timed
                assert run["tokens"] == expected, (entry["dtype"], entry["concurrency"], name)
                assert run["expected_tokens"] == expected


def test_aims_are_judged_for_the_dtype(report: dict[str, Any]) -> None:
    aims = report["aims"]
    assert len(aims) == len(AIMS)
    for aim in aims:
        assert isinstance(aim["met"], bool)
        assert aim["met"] == (aim["measured"] >= aim["target"])
    names = {aim["name"] for aim in aims}
    assert "bfloat16: one-worker >= 0.9x runtime at N=32" in names
    text = format_report(report)
    assert text.count("runtime/transformers") == 1  # a table header per dtype
    assert text.count("one-worker/runtime") == 1
    assert "aims:" in text
    # Only N=32 times fewer transformers requests than it has.
    assert text.count("extrapolated") == 1


def test_check_tokens_rejects_a_system_that_made_fewer() -> None:
    short = Measurement(
        "runtime", requests=2, timed_requests=2, tokens=9, expected_tokens=10, seconds=1.0
    )
    with pytest.raises(BenchmarkError, match="generated 9 tokens .* expected 10"):
        check_tokens(short)
    exact = Measurement(
        "runtime", requests=2, timed_requests=2, tokens=10, expected_tokens=10, seconds=2.0
    )
    assert check_tokens(exact).tokens_per_s == 5.0


def test_prompts_encode_to_exactly_the_requested_length(tiny_folder: Path) -> None:
    tokenizer = ChatTokenizer.from_folder(tiny_folder)
    prompts = build_prompts(tokenizer, 6, 20)
    assert len({p.text for p in prompts}) == 6  # all different
    for prompt in prompts:
        assert len(prompt.ids) == 20
        assert tokenizer.encode(prompt.text) == list(prompt.ids)


def test_kv_cache_budget_holds_every_sequence(tmp_path: Path) -> None:
    config = {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    # float32: 2 (K, V) * 30 layers * 16 slots * 3 heads * 64 dims * 4 bytes = 737280 per
    # block; 32 sequences * (192 / 16 + 1 spare) blocks = 416 blocks.
    assert kv_cache_bytes_for(tmp_path, "float32", 32, 192) == 416 * 737280
    # bfloat16 needs half of that, less than the engine default, which is kept.
    assert kv_cache_bytes_for(tmp_path, "bfloat16", 32, 192) == DEFAULT_KV_CACHE_BYTES
    with pytest.raises(BenchmarkError, match="config.json"):
        kv_cache_bytes_for(tmp_path / "missing", "float32", 1, 1)


def test_presets_and_config_checks() -> None:
    quick = preset("quick")
    assert (quick.dtypes, quick.concurrency, quick.new_tokens, quick.repeat) == (
        ("bfloat16",),
        (1, 8),
        32,
        1,
    )
    default = preset("default")
    assert default.dtypes == ("bfloat16", "float32") and default.concurrency == (1, 8, 32)
    assert (default.prompt_tokens, default.new_tokens) == (64, 128)
    assert preset("full").transformers_requests is None
    with pytest.raises(BenchmarkError, match="dtypes"):
        DecodeConfig(dtypes=("int8",))
    with pytest.raises(BenchmarkError, match="unknown mode"):
        preset("slow")
