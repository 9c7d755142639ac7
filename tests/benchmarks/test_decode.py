"""The decode benchmark, run end to end on the tiny random checkpoint (never SmolLM2 here).

No timing is asserted: only that the report has every system, configuration, ratio and aim,
and that every system generated exactly the tokens it was asked for, counted.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.decode import (
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
from mstar_async.cli import main
from mstar_async.models.causal_lm import DEFAULT_KV_CACHE_BYTES
from mstar_async.models.checkpoints import ChatTokenizer

CONCURRENCY = (1, 3, 32)  # 1 and 32 are the concurrencies the aims name
NEW_TOKENS = 5
PROMPT_TOKENS = 12
REPEAT = 2


@pytest.fixture(scope="module")
def report(tiny_folder: Path) -> dict[str, Any]:
    """One run through the CLI, as a user types it: JSON on stdout and nothing else there."""
    out, err = io.StringIO(), io.StringIO()
    argv = [
        "bench",
        "decode",
        "--json",
        "--full",  # every transformers request timed, so all three make N * new tokens
        "--folder",
        str(tiny_folder),
        "--dtype",
        "both",
        "--concurrency",
        ",".join(map(str, CONCURRENCY)),
        "--new-tokens",
        str(NEW_TOKENS),
        "--prompt-tokens",
        str(PROMPT_TOKENS),
        "--repeat",
        str(REPEAT),
        "--retries",
        "0",  # no timing is judged here, so a busy machine need not cost reruns
    ]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0
    assert "warming up runtime" in err.getvalue()  # progress goes to stderr
    parsed: dict[str, Any] = json.loads(out.getvalue())  # the whole of stdout is one object
    return parsed


def test_report_has_every_system_configuration_and_ratio(report: dict[str, Any]) -> None:
    assert report["benchmark"] == "decode"
    assert set(report["systems"]) == set(SYSTEMS)
    for key in ("cpu_model", "torch_version", "torch_threads", "transformers_version"):
        assert report["machine"][key]
    assert report["workload"]["new_tokens"] == NEW_TOKENS
    assert report["workload"]["transformers_requests"] is None
    configurations = {(r["dtype"], r["concurrency"]) for r in report["results"]}
    assert configurations == {(d, n) for d in ("bfloat16", "float32") for n in CONCURRENCY}
    for entry in report["results"]:
        assert set(entry["systems"]) == set(SYSTEMS)
        assert set(entry["ratios"]) == {f"{a}/{b}" for a, b in RATIOS}
        for ratio in entry["ratios"].values():
            assert ratio["n"] == REPEAT and ratio["min"] <= ratio["median"] <= ratio["max"]
        for name in SYSTEMS:
            system = entry["systems"][name]
            assert system["tokens_per_s"]["n"] == REPEAT
            assert system["tokens_per_s"]["median"] > 0
            assert len(system["repetitions"]) == REPEAT
            assert system["extrapolated"] is False
        assert entry["discarded_repetitions"] == 0  # --retries 0
        assert entry["contaminated_repetitions"] >= 0
        assert entry["systems"]["runtime"]["ttft_ms_p50"]["median"] > 0
        assert entry["systems"]["handloop"]["itl_ms_p50"]["median"] > 0


def test_every_system_generated_exactly_n_times_new_tokens(report: dict[str, Any]) -> None:
    for entry in report["results"]:
        expected = entry["concurrency"] * NEW_TOKENS
        for name in SYSTEMS:
            for run in entry["systems"][name]["repetitions"]:
                assert run["foreign_cores"] is None or run["foreign_cores"] >= 0
                assert run["timed_requests"] == entry["concurrency"]
                assert run["tokens"] == expected, (entry["dtype"], entry["concurrency"], name)
                assert run["expected_tokens"] == expected


def test_aims_are_judged_for_each_dtype(report: dict[str, Any]) -> None:
    aims = report["aims"]
    assert len(aims) == 2 * len(AIMS)
    for aim in aims:
        assert isinstance(aim["met"], bool)
        assert aim["met"] == (aim["measured"] >= aim["target"])
    text = format_report(report)
    assert text.count("runtime/transformers") == 2  # a table header per dtype
    assert "aims:" in text and "extrapolated" not in text


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
