"""``mstar bench speech``: the playback simulation, the non-streaming baseline's audio, and the
quick path end to end on the tiny model (every system, consistent figures; no speed asserted)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.bench.speech import (
    OURS,
    SYSTEMS,
    SpeechConfig,
    codes_model,
    format_report,
    lm_options,
    load_prompts,
    plot_report,
    preset,
    request_inputs,
    simulate_playback,
    timing_of,
)
from mstar_async.cli import main
from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk
from mstar_async.runtime import open_runtime
from tests.benchmarks.runs import BenchRun

pytestmark = pytest.mark.timeout(120)


def test_playback_counts_late_chunks_and_their_gaps() -> None:
    # Chunks of 1 s: the 2nd arrives while the 1st plays (audio until 3.0), the 3rd 0.5 s
    # after that ran out, the 4th while the 3rd plays.
    played = simulate_playback([(1.0, 1.0), (1.5, 1.0), (3.5, 1.0), (4.0, 1.0)])
    assert played.underruns == 1
    assert played.stall_s == pytest.approx(0.5)
    assert simulate_playback([(0.2, 0.1)]).underruns == 0
    assert simulate_playback([]).underruns == 0


_chunks = st.lists(
    st.tuples(st.floats(0, 10, allow_nan=False), st.floats(0.01, 2, allow_nan=False)),
    min_size=1,
    max_size=30,
).map(lambda cs: sorted(cs))


@given(_chunks)
def test_playback_invariants(chunks: list[tuple[float, float]]) -> None:
    played = simulate_playback(chunks)
    assert 0 <= played.underruns <= len(chunks) - 1
    assert played.stall_s >= 0
    assert (played.underruns == 0) == (played.stall_s == 0)
    # Playback ends at first arrival + all audio + stalls, and never before the last arrival.
    end = chunks[0][0] + sum(s for _, s in chunks) + played.stall_s
    assert end >= chunks[-1][0] + chunks[-1][1] - 1e-9
    # All audio already there at the first chunk: nothing can come late.
    assert simulate_playback([(chunks[0][0], s) for _, s in chunks]).underruns == 0


def test_timing_of_a_request() -> None:
    timing = timing_of([(0.5, 1.0), (2.0, 1.0)], 2.1)
    assert (timing.ttfa_s, timing.audio_s, timing.chunks) == (0.5, 2.0, 2)
    assert timing.rtf == pytest.approx(1.05) and timing.underruns == 1
    with pytest.raises(RuntimeError, match="no audio"):
        timing_of([], 1.0)


def test_config_and_inputs() -> None:
    prompts = load_prompts()
    assert 20 <= len(prompts) <= 30
    config = preset(False)
    assert (config.size, config.concurrency, config.threads) == ("small", (1, 4, 16), 1)
    assert config.max_tokens == 211 and config.systems == SYSTEMS
    first, wrapped = (
        request_inputs(config, 0, prompts),
        request_inputs(config, len(prompts), prompts),
    )
    assert first["text"] == wrapped["text"] and wrapped["seed"] == first["seed"] + len(prompts)
    assert preset(True, "qwen3-omni").systems == ("streaming", "streaming_split", "sequential")
    with pytest.raises(ValueError, match="runs only"):
        SpeechConfig(model="qwen3-omni")
    with pytest.raises(ValueError, match="systems"):
        SpeechConfig(systems=("nonsense",))
    with pytest.raises(ValueError, match="orpheus only"):
        SpeechConfig(model="qwen3-tts", systems=("streaming",), quantize="int8")
    with pytest.raises(ValueError, match="qwen3-tts only"):
        SpeechConfig(encoders="released")
    with pytest.raises(ValueError, match="ray runs streaming_split's ranks on a cluster"):
        SpeechConfig(systems=("streaming",), ray="auto")
    assert SpeechConfig(systems=("streaming", "streaming_split"), ray="auto").ray == "auto"
    assert lm_options("int4") == {"quantize": "int4", "dtype": "bfloat16"} and not lm_options(None)


@pytest.mark.anyio
@pytest.mark.parametrize("quantize", [None, "int8"])
async def test_non_streaming_baseline_makes_the_streamed_audio(quantize: str | None) -> None:
    # Baseline (a) must be the same model, only without streaming: same samples, one chunk;
    # with --quantize, both in the same weight form.
    inputs = request_inputs(preset(True), 3, load_prompts())
    inputs["max_tokens"] = 36  # 5 frames

    async def collect(model: Any) -> list[torch.Tensor]:
        async with open_runtime(model) as runtime, runtime.generate(**inputs) as outputs:
            return [item.pcm async for item in outputs if isinstance(item, AudioChunk)]

    torch.set_num_threads(1)
    streamed = await collect(build_model("orpheus", size="tiny", **lm_options(quantize)))
    (whole,) = await collect(codes_model("tiny", vocode=True, quantize=quantize))
    assert len(streamed) > 1 and whole.numel() == 5 * 2048
    torch.testing.assert_close(torch.cat(streamed), whole)


@pytest.fixture(scope="module")
def report(speech_run: BenchRun) -> dict[str, Any]:
    assert "N=3 pipeline" in speech_run.progress  # progress goes to stderr
    return speech_run.report


def test_quick_report_figures_are_consistent(report: dict[str, Any]) -> None:
    work = report["workload"]
    assert (work["model"], work["size"], work["max_tokens"], work["threads"]) == (
        "orpheus",
        "tiny",
        36,
        1,
    )
    assert [r["concurrency"] for r in report["results"]] == [1, 3]
    for result in report["results"]:
        n = result["concurrency"]
        assert set(result["systems"]) == set(SYSTEMS)
        for name, f in result["systems"].items():
            assert f["requests"] == n
            assert 0 < f["ttfa_p50_s"] <= f["ttfa_p95_s"] and f["ttfa_p50_s"] <= f["e2e_p50_s"]
            assert 0 < f["rtf_p50"] <= f["rtf_p95"]
            assert f["underruns"] >= 0 and f["stall_s_total"] >= 0
            assert 0 <= f["requests_with_underruns"] <= n
            # Every system speaks the same 5 frames per request: same seeds, same weights.
            assert f["audio_s_p50"] == pytest.approx(5 * 2048 / 24_000, abs=1e-3)
            assert f["throughput_audio_s_per_s"] == pytest.approx(
                f["audio_s_total"] / f["wall_s"], rel=1e-2
            )
            if name in ("non_streaming", "pipeline"):
                # One chunk with all the audio: no underrun possible, first audio is the end.
                assert f["chunks_per_request_p50"] == 1 and f["underruns"] == 0
                # (the non-streaming request ends a moment after its chunk: it releases its KV)
                assert f["ttfa_p50_s"] == pytest.approx(f["e2e_p50_s"], rel=0.2)
            else:
                assert f["chunks_per_request_p50"] > 1
        ratios = result["ratios"]["throughput"]
        ours = result["systems"]["streaming"]["throughput_audio_s_per_s"]
        seq = result["systems"]["sequential"]["throughput_audio_s_per_s"]
        assert ratios["streaming/sequential"] == pytest.approx(ours / seq, rel=1e-2)
    assert [s["name"] for s in report["systems"]] == list(SYSTEMS)
    # Named "LAYOUT: WHAT ...": TTFA, throughput or RTF of one layout of the runtime.
    aims = {(a["system"], a["name"].split(": ")[1].split(" ")[0]): a for a in report["aims"]}
    assert set(aims) == {(ours, what) for ours in OURS for what in ("TTFA", "throughput", "RTF")}
    assert all(isinstance(aim["met"], bool) for aim in aims.values())
    split = aims[("streaming_split", "throughput")]
    last = report["results"][-1]
    assert split["measured"] == last["ratios"]["throughput"]["streaming_split/sequential"]
    assert split["concurrency"] == 3 and split["target"] == 3.0
    rtf = aims[("streaming", "RTF")]
    assert rtf["measured"] == max(rtf["by_concurrency"].values())
    assert rtf["met"] == (rtf["measured"] < 1) and rtf["compare"] == "<"


def test_text_report_and_plot(report: dict[str, Any], tmp_path: Path) -> None:
    text = format_report(report)
    rows = [line.split() for line in text.splitlines() if line[:3].strip().isdigit()]
    assert [(row[0], row[1]) for row in rows if row[1] == "pipeline"] == [
        ("1", "pipeline"),
        ("3", "pipeline"),
    ]
    assert len(rows) == 2 * len(SYSTEMS)
    assert "aim streaming_split: throughput at N=3 >= 3x sequential" in text
    if plot_report(report, tmp_path / "speech.png"):
        assert (tmp_path / "speech.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_options_are_refused() -> None:
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as exited:
        main(["bench", "speech", "--concurrency", "0"])
    assert exited.value.code == 2
