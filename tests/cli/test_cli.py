"""The ``mstar`` command and the shipped example, run as a user would."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mstar_async.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_mstar_help_lists_the_commands() -> None:
    result = subprocess.run(
        ["mstar", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    assert "models" in result.stdout and "run" in result.stdout


def test_the_program_exits_with_mains_status_and_starts_without_rich() -> None:
    """``python -m mstar_async.cli`` ends through ``mstar_async.command.run``, as the console
    script does (status kept, output flushed); logging loads structlog without rich, which it
    would import for nothing."""
    ok = subprocess.run(
        [sys.executable, "-m", "mstar_async.cli", "models"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and "causal-lm" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "mstar_async.cli", "run", "no-such-model"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2, bad.stderr
    unknown = subprocess.run(
        [sys.executable, "-m", "mstar_async.command", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        unknown.returncode == 1 and "no program 'nope'; programs: mstar, worker" in unknown.stderr
    )
    probe = "import sys, mstar_async.logs; print('rich' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert loaded.stdout.strip() == "False"


def test_mstar_models_lists_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    assert "demo" in capsys.readouterr().out


def test_mstar_run_demo_prints_a_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "demo", "--json", "--max-codes", "16", "--steps", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["audio_chunks"] == 3  # a window of 8 codes, then two strides of 4
    assert summary["audio_seconds"] == pytest.approx(16 * 320 / 16_000)
    assert summary["images"] == [[3, 16, 16]]
    assert 0 < summary["seconds_to_first_output"] <= summary["seconds_total"]


def test_mstar_run_rejects_an_unknown_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "demo", "--bogus", "1"]) == 2
    assert "takes no input --bogus" in capsys.readouterr().err


def test_mstar_run_rejects_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "nope"]) == 2
    assert "no model 'nope'" in capsys.readouterr().err


def test_quickstart_example_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "first audio after" in result.stdout
    assert "image: (3, 16, 16)" in result.stdout


def test_mstar_run_bagel_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    out = tmp_path / "out.png"
    argv = ["run", "bagel", "--prompt", "a red circle", "--steps", "2", "-o", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "image: 3x64x64" in printed
    assert f"wrote {out}" in printed
    assert "request took" in printed
    with Image.open(out) as image:
        assert image.size == (64, 64) and image.mode == "RGB"


@pytest.mark.parametrize("keyed", [False, True], ids=["loopback", "curve-keys"])
def test_mstar_run_serves_a_rank_joined_by_mstar_worker(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, keyed: bool
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    keys: list[str] = []
    if keyed:
        assert main(["keys", "generate", str(tmp_path / "keys")]) == 0
        capsys.readouterr()
        keys = ["--curve-keys", str(tmp_path / "keys")]
    conductor = f"tcp://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mstar_async.cli", "worker", "--conductor", conductor]
    worker = subprocess.Popen(
        [*command, "--rank", "1", "--threads", "1", *keys],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        placement = str(ROOT / "examples" / "placements" / "codec_split.yaml")
        serve = ["run", "demo", "--json", "--placement", placement, "--listen", conductor, *keys]
        code = main([*serve, "--join", "1", "--max-codes", "16", "--steps", "2"])
        assert code == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["audio_chunks"] == 3 and summary["images"] == [[3, 16, 16]]
        _, err = worker.communicate(timeout=30)
        assert worker.returncode == 0, err
        assert "rank 1: joined" in err
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()


def test_mstar_run_listen_needs_a_placement(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "demo", "--listen", "tcp://127.0.0.1:5555"]) == 2
    assert "--listen needs --placement" in capsys.readouterr().err


def test_mstar_worker_rejects_a_bad_conductor(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--conductor", "10.0.0.1", "--rank", "0"]) == 2
    assert "tcp://HOST:PORT" in capsys.readouterr().err


def test_mstar_keys_generate_writes_a_key_folder_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "keys"
    assert main(["keys", "generate", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "worker hosts: runtime.key, worker.key and worker.key_secret" in out
    assert sorted(p.name for p in folder.iterdir()) == [
        "runtime.key",
        "runtime.key_secret",
        "worker.key",
        "worker.key_secret",
    ]
    assert main(["keys", "generate", str(folder)]) == 2
    assert "not overwriting keys" in capsys.readouterr().err


def test_mstar_worker_refuses_what_it_cannot_secure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    worker = ["worker", "--rank", "0", "--conductor"]
    assert main([*worker, "tcp://10.0.0.1:5555"]) == 2
    assert "refusing to join tcp://10.0.0.1:5555 without CURVE keys" in capsys.readouterr().err
    nowhere = str(tmp_path / "nowhere")
    assert main([*worker, "tcp://127.0.0.1:5555", "--curve-keys", nowhere]) == 2
    assert f"no CURVE key folder {nowhere}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*worker, "tcp://127.0.0.1:5555", "--source", "no-function"])
    assert "expected MODULE:FUNCTION" in capsys.readouterr().err
