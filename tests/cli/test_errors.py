"""A user's mistakes on the command line: one line on stderr, no traceback, printed once, before
anything is built or printed; typed inputs, writable outputs, checkpoint options, required
inputs. Exit status 2 for a mistake in the command, 1 for a request that failed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mstar_async.cli import main

pytestmark = pytest.mark.timeout(120)

#: Progress lines that must not come before a mistake is reported.
PROGRESS = ("building", "loading", "ready", "serving")


def fails(argv: list[str], capsys: pytest.CaptureFixture[str], status: int = 2) -> str:
    """Run ``mstar *argv``; it must exit with ``status`` having printed nothing on stdout and
    one line, no traceback and no progress, on stderr. Returns that line."""
    assert main(argv) == status
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and not lines[0].startswith(PROGRESS)
    return lines[0]


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--max-codes", "1.5", "--max-codes expects an integer, got '1.5'"),
        ("--guidance", "abc", "--guidance expects a number, got 'abc'"),
        ("--image", "maybe", "--image expects true or false, got 'maybe'"),
    ],
)
def test_a_typed_input_of_the_wrong_type_is_one_line(
    flag: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fails(["run", "demo", flag, value], capsys) == f"mstar run: {expected}"


@pytest.mark.parametrize(
    ("flag", "value", "kind"),
    [("--max-tokens", "1.5", "an integer"), ("--temperature", "abc", "a number")],
)
def test_max_tokens_and_temperature_name_their_flag_in_a_fresh_process(
    flag: str, value: str, kind: str
) -> None:
    # The command as a user runs it, in a process of its own: no traceback reaches the terminal.
    command = [sys.executable, "-m", "mstar_async.cli", "run", "orpheus", "--text", "Hi"]
    result = subprocess.run(
        [*command, flag, value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == f"mstar run: {flag} expects {kind}, got '{value}'\n"
    assert result.stdout == ""


def test_an_input_without_a_value_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert fails(["run", "demo", "--max-codes"], capsys) == "mstar run: --max-codes needs a value"


def test_an_unknown_model_prints_no_progress(capsys: pytest.CaptureFixture[str]) -> None:
    assert "no model 'gpt4'" in fails(["run", "gpt4"], capsys)
    assert "no model 'gpt4'" in fails(["serve", "gpt4"], capsys)


def test_an_output_that_cannot_be_written_is_refused_before_generating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-folder" / "hello.wav"
    line = fails(["run", "orpheus", "--text", "Hi", "-o", str(missing)], capsys)
    assert line == f"mstar run: cannot write {missing}: there is no folder {missing.parent}"
    folder = tmp_path / "taken.wav"
    folder.mkdir()
    line = fails(["run", "orpheus", "--text", "Hi", "-o", str(folder)], capsys)
    assert line == f"mstar run: cannot write {folder}: it is a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.wav"]


def test_a_writable_output_is_not_left_behind_by_a_refused_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hello.wav"
    fails(["run", "orpheus", "--text", "Hi", "--max-tokens", "x", "-o", str(out)], capsys)
    assert not out.exists()


def test_a_failed_request_is_reported_once(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "causal-lm", "--path", str(tiny_folder), "--prompt", "Hi", "--max-tokens", "0"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("loading ")]
    assert len(lines) == 1, err  # not also the conductor's request.failed log event
    assert lines[0].startswith("mstar run: request ") and "max_tokens" in lines[0]
    assert "Traceback" not in err and out == ""


def test_a_speech_model_needs_its_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert fails(["run", "orpheus", "--max-tokens", "28"], capsys) == (
        "mstar run: model 'orpheus' needs --text"
    )
    assert fails(["run", "qwen3-omni"], capsys) == "mstar run: model 'qwen3-omni' needs --text"


def test_a_text_model_needs_its_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    assert fails(["run", "causal-lm"], capsys) == "mstar run: model 'causal-lm' needs --prompt"


def test_inputs_with_documented_defaults_keep_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "demo", "--max-codes", "32", "--steps", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["audio_chunks"] > 0


def test_path_loads_a_real_checkpoint_on_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.models.test_orpheus import write_orpheus_folders

    lm_dir, snac_dir = write_orpheus_folders(tmp_path)
    argv = ["run", "orpheus", "--path", str(lm_dir), "--snac-path", str(snac_dir), "--json"]
    assert main([*argv, "--text", "Hi there", "--max-tokens", "28"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["audio_seconds"] > 0
    assert err.splitlines() == ["loading orpheus ..."]


def test_path_options_are_checked_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = fails(["run", "demo", "--path", str(tmp_path)], capsys)
    assert line.startswith("mstar run: model 'demo' takes no --path (models that do: causal-lm")
    line = fails(["run", "orpheus", "--text", "Hi", "--path", str(tmp_path / "nope")], capsys)
    assert line == f"mstar run: --path {tmp_path / 'nope'}: no such file or folder"
    line = fails(["run", "orpheus", "--text", "Hi", "--snac-path", str(tmp_path)], capsys)
    assert line.endswith(
        "config.json is missing: a SNAC folder holds config.json and "
        "pytorch_model.bin (as in hubertsiuzdak/snac_24khz)"
    )
    line = fails(["run", "causal-lm", "--snac-path", str(tmp_path)], capsys)
    assert "takes no --snac-path (models that do: orpheus)" in line


def test_listen_and_join_are_checked_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    placement = str(Path(__file__).resolve().parents[2] / "examples/placements/codec_split.yaml")
    listen = ["--placement", placement, "--listen", "tcp://127.0.0.1:5555"]
    line = fails(["run", "demo", *listen, "--join", "-1"], capsys)
    assert line == "mstar run: --join -1: ranks must be >= 0, got [-1]"
    line = fails(["run", "demo", "--listen", "10.0.0.1", "--placement", placement], capsys)
    assert "tcp://" in line
    assert fails(["run", "demo", "--join", "1"], capsys) == (
        "mstar run: --join needs --listen: the address the ranks join"
    )
    everywhere = ["--placement", placement, "--listen", "tcp://0.0.0.0:5555"]
    line = fails(["run", "demo", *everywhere], capsys)
    assert line.startswith("mstar run: refusing to listen on tcp://0.0.0.0:5555 without CURVE")
    line = fails(["run", "demo", *everywhere, "--curve-keys", "/no/such/keys"], capsys)
    assert line.startswith("mstar run: no CURVE key folder /no/such/keys")


def test_a_builder_option_out_of_range_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = fails(["run", "bagel", "--size", "huge"], capsys)
    expected = "cannot build bagel: unknown bagel size 'huge'; sizes: ['small', 'tiny']"
    assert line == f"mstar run: {expected}"


def test_serve_checks_its_port_before_loading_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = fails(["serve", "demo", "--port", str(port)], capsys)
    assert line.startswith(f"mstar serve: cannot listen on 127.0.0.1:{port}: ")


def test_serve_refuses_path_for_a_model_without_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = fails(["serve", "demo", "--path", str(tmp_path)], capsys)
    assert line.startswith("mstar serve: model 'demo' takes no --path")


def test_a_bad_log_level_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--log-level", "loud", "models"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'LOUD'" in err and "Traceback" not in err


def test_serve_checks_ray_and_listen_before_loading(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mstar_async.cli import launch

    placement = str(Path(__file__).resolve().parents[2] / "examples/placements/codec_split.yaml")
    placed = ["serve", "demo", "--placement", placement]
    assert fails(["serve", "demo", "--ray", "auto"], capsys) == (
        "mstar serve: --ray runs the ranks of placed models: give --placement [MODEL=]FILE"
    )
    line = fails([*placed, "--ray", "head-without-port"], capsys)
    assert line.startswith("mstar serve: --ray head-without-port: expected auto or HOST:PORT")
    assert fails([*placed, "--ray", "ray://10.0.0.1:10001"], capsys).startswith(
        "mstar serve: --ray ray://10.0.0.1:10001: expected auto or HOST:PORT"
    )
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    line = fails([*placed, "--ray", f"127.0.0.1:{port}"], capsys)
    assert line.startswith(f"mstar serve: --ray 127.0.0.1:{port}: no Ray cluster answers there")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launch, "RAY_CURRENT_CLUSTER", tmp_path / "no-cluster")
    line = fails([*placed, "--ray", "auto"], capsys)
    assert line.startswith("mstar serve: --ray auto: no Ray cluster runs on this host")
    line = fails([*placed, "--ray", "auto", "--listen", "tcp://127.0.0.1:5555"], capsys)
    assert line == "mstar serve: --ray and --listen both say where ranks run: give one of them"
    assert fails(["serve", "demo", "--listen", "tcp://127.0.0.1:5555"], capsys) == (
        "mstar serve: --listen needs --placement: its hosts: say which ranks join"
    )
    line = fails([*placed, "--listen", "tcp://0.0.0.0:5555"], capsys)
    assert line.startswith("mstar serve: refusing to listen on tcp://0.0.0.0:5555 without CURVE")
    two = ["serve", "demo", "orpheus", "--placement", f"demo={placement}"]
    two += ["--placement", f"orpheus={placement}", "--listen", "tcp://127.0.0.1:5555"]
    assert fails(two, capsys) == (
        "mstar serve: --listen serves the ranks of one placed model, not 2: place one"
    )
