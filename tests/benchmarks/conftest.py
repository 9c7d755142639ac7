"""Each benchmark run once per session as a user types it, ``mstar bench NAME --quick --json``
with options that make it as small as it goes (tiny models, few tokens, one or two
repetitions); the benchmark's own tests and the report-shape test share these runs.

A test that needs a run (a fixture named ``*_run``) is in the ``slow`` set: the README's test
command leaves them out and ``.ci/run`` runs them after it. Tests of the benchmarks' own
helpers stay in the default set.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.runs import (
    DECODE_CONCURRENCY,
    DECODE_NEW_TOKENS,
    DECODE_PROMPT_TOKENS,
    DECODE_REPEAT,
    DECODE_TRANSFORMERS_REQUESTS,
    OVERHEAD_CONCURRENCY,
    OVERHEAD_ITERATIONS,
    OVERHEAD_SYSTEMS,
    BenchRun,
    run_bench,
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tryfirst: before ``-m`` selects by marker.
    for item in items:
        if any(name.endswith("_run") for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def decode_run(tiny_folder: Path) -> BenchRun:
    return run_bench(
        "decode",
        "--quick",
        "--json",
        "--folder",
        str(tiny_folder),
        "--dtype",
        "bf16",  # the other dtypes take the same path; one keeps the suite short
        "--concurrency",
        ",".join(map(str, DECODE_CONCURRENCY)),
        "--new-tokens",
        str(DECODE_NEW_TOKENS),
        "--prompt-tokens",
        str(DECODE_PROMPT_TOKENS),
        "--repeat",
        str(DECODE_REPEAT),
        "--transformers-requests",
        str(DECODE_TRANSFORMERS_REQUESTS),
        "--retries",
        "0",  # no timing is judged here, so a busy machine need not cost reruns
    )


@pytest.fixture(scope="session")
def transport_run() -> BenchRun:
    return run_bench("transport", "--quick", "--json")


@pytest.fixture(scope="session")
def image_run() -> BenchRun:
    return run_bench("image", "--quick", "--json", "--size", "tiny", "--steps", "2")


@pytest.fixture(scope="session")
def rollout_run() -> BenchRun:
    argv = ("--size", "tiny", "--horizons", "2,5", "--repeat", "2")
    return run_bench("rollout", "--quick", "--json", *argv)


@pytest.fixture(scope="session")
def vla_run() -> BenchRun:
    return run_bench("vla", "--quick", "--json", "--concurrency", "1,3", "--steps", "2")


@pytest.fixture(scope="session")
def speech_run() -> BenchRun:
    argv = ("--concurrency", "1,3", "--max-tokens", "36")
    return run_bench("speech", "--quick", "--json", *argv)


@pytest.fixture(scope="session")
def overhead_run() -> BenchRun:
    concurrency = ",".join(map(str, OVERHEAD_CONCURRENCY))
    argv = ("--concurrency", concurrency, "--iterations", str(OVERHEAD_ITERATIONS))
    systems = ",".join(OVERHEAD_SYSTEMS)
    return run_bench("overhead", "--quick", "--json", *argv, "--repeat", "1", "--systems", systems)


@pytest.fixture(scope="session")
def soak_run() -> BenchRun:
    return run_bench("soak", "--quick", "--json", "--minutes", "0.05")


@pytest.fixture(scope="session")
def load_run() -> BenchRun:
    return run_bench("load", "--quick", "--json", "--size-gb", "0.0625", "--ranks", "all,talker")


@pytest.fixture(scope="session")
def moe_run() -> BenchRun:
    return run_bench("moe", "--quick", "--json", "--tokens", "1,3", "--threads", "1")


@pytest.fixture(scope="session")
def realtime_run() -> BenchRun:
    return run_bench("realtime", "--quick", "--json", "--sessions", "1,2")
