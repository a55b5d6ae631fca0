"""A mistake in a config file is one readable line and exit 2, before anything starts
(`flexpipe controller`, `flexpipe up`, also with --dry-run); one duration grammar for every
command; and under `flexpipe up` the controller's admin API has the gateway's token, which
`flexpipe cluster` finds by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from test_launcher import marker, processes_with  # noqa: F401  (fixture)
from test_up import wait_for_line, write_models
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.cli.common import one_line, read_yaml
from flexpipe.cli.durations import parse_duration_s, parse_since, parse_until
from flexpipe.launch import free_port

runner = CliRunner(env={"COLUMNS": "200"})


def _store(tmp_path: Path) -> list[str]:
    return ["--store", f"sqlite:///{tmp_path / 'fp.db'}"]


def _one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output and len(lines) == 1, output
    assert lines[0].startswith("error: "), output
    return lines[0]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out = {
        "cluster": "nodes: [\n bad",  # the review's typo
        "models": "models: [\n bad",
        "shift": "shift:\n  cooldown_s: [1\n",
        "unknown": "shift:\n  bogus: 1\n",
    }
    paths = {}
    for name, text in out.items():
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(text)
    return paths


def test_controller_config_mistakes_are_one_line_exit_2(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    port = ["--port", str(free_port()), *_store(tmp_path)]
    cases = [
        (["--cluster", str(files["cluster"])],
         f"error: {files['cluster']}: line 3, column 1: YAML syntax error: while parsing a "
         "flow sequence; did not find expected ',' or ']'"),
        (["--cluster", "/nonexistent.yaml"],
         "error: /nonexistent.yaml: cannot read the file: No such file or directory"),
        (["--models", str(files["models"])],
         f"error: {files['models']}: line 2, column 5: YAML syntax error: while parsing a "
         "flow sequence; expected ',' or ']', but got '<stream end>'"),
        (["--shift-config", str(files["shift"])],
         f"error: {files['shift']}: line 3, column 1: YAML syntax error: while parsing a "
         "flow sequence; expected ',' or ']', but got '<stream end>'"),
        (["--shift-config", str(files["unknown"])],
         f"error: {files['unknown']}: shift: unknown key(s) bogus; known: "),
    ]  # fmt: skip
    for args, expected in cases:
        res = runner.invoke(app, ["controller", *args, *port])
        assert res.exit_code == 2, (args, res.output)
        assert _one_error_line(res.output).startswith(expected), (args, res.output)


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "up"])
def test_up_checks_every_file_before_it_starts_anything(
    tmp_path: Path, files: dict[str, Path], dry_run: bool
) -> None:
    args = ["up", "--port", str(free_port()), *_store(tmp_path)]
    args += ["--dry-run"] if dry_run else []
    for extra, expected in [
        (["--shift-config", str(files["shift"])], "line 3, column 1: YAML syntax error"),
        (["--shift-config", str(tmp_path / "nope.yaml")], "cannot read the file"),
        (["--shift-config", str(files["unknown"])], "unknown key(s) bogus"),
        (["--models", str(files["models"])], "line 2, column 5: YAML syntax error"),
        (["--cluster", str(files["cluster"])], "line 3, column 1: YAML syntax error"),
        (["--admin-token-file", str(tmp_path / "nope")], "cannot read"),
    ]:
        res = runner.invoke(app, [*args, *extra])
        assert res.exit_code == 2, (extra, res.output)
        assert expected in _one_error_line(res.output)  # no plan printed, nothing started


def test_any_yaml_error_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n b")
    with pytest.raises(ValueError) as info:
        read_yaml(bad)
    assert "\n" not in str(info.value) and "line 2, column 3" in str(info.value)
    try:
        yaml.safe_load(bad.read_text())
    except yaml.YAMLError as exc:
        raw = exc
    assert str(raw).count("\n") >= 4  # PyYAML's own
    assert one_line(raw).startswith("line 2, column 3: YAML syntax error: ")
    try:  # a loader that quoted PyYAML's message (control/engines/launching.py's load_models does)
        try:
            yaml.safe_load(bad.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{bad}: YAML syntax error: {exc}") from None
    except ValueError as wrapped:
        assert one_line(wrapped) == f"{bad}: " + one_line(raw)


def test_one_duration_grammar_for_since_and_until() -> None:
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    for text, seconds in [("90s", 90), ("10m", 600), ("1h30m", 5400), ("1.5h", 5400),
                          ("2d", 172800), ("1d12h", 129600), ("2m30s", 150), ("1h 30m", 5400),
                          ("0.5h", 1800)]:  # fmt: skip
        assert parse_duration_s(text) == seconds, text
        assert parse_since(text, now) == now - timedelta(seconds=seconds)
        assert parse_until(text, now.timestamp()) == now.timestamp() + seconds
    for bad in ("10x", "yesterday", "-5m", "", "h", "30m1h"):
        assert parse_duration_s(bad) is None
        with pytest.raises(ValueError, match="bad --since"):
            parse_since(bad, now)
    assert parse_since("2026-12-01T11:00:00", now) == datetime(2026, 12, 1, 11, tzinfo=UTC)
    with pytest.raises(ValueError, match="the duration must be more than 0"):
        parse_until("0m", now.timestamp())
    with pytest.raises(ValueError, match=r"is in the past \(3600 s ago\)"):
        parse_until("2026-12-01T11:00:00Z", now.timestamp())


def test_occupy_until_bad_is_one_line() -> None:
    res = runner.invoke(app, ["cluster", "occupy", "gpu0", "--until", "soon",
                              "--controller", f"http://127.0.0.1:{free_port()}"])  # fmt: skip
    assert res.exit_code == 2
    assert "--until 'soon': expected a duration (90s, 10m, 2h, 1h30m, 1d)" in res.output


def test_the_controller_of_up_wants_the_admin_token_and_cluster_finds_it(
    marker: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    port, cport = free_port(), free_port()
    controller = f"http://127.0.0.1:{cport}"
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--port", str(port), "--controller-port",
        str(cport), "--time-scale", "0.02", "--tick-s", "600",
        "--models", str(write_models(tmp_path, marker)), *_store(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    env.pop("FLEXPIPE_CONTROLLER_TOKEN", None)
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        lines = wait_for_line(proc, "controller: admin API on", 120)
        token_line = next(line for line in lines if line.startswith("admin token in "))
        token_file = Path(token_line.split()[3])
        assert (token_file.parent / "pid").read_text() == str(proc.pid)
        cli = [sys.executable, "-m", "flexpipe", "cluster"]
        wrong = subprocess.run([*cli, "occupy", "gpu0", "--until", "1h", "--token", "wrong",
                                "--controller", controller],
                               capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
        assert wrong.returncode == 1, wrong.stdout + wrong.stderr
        assert _one_error_line(wrong.stderr).startswith(
            "error: the controller refused (401): admin API: missing or wrong bearer token"
        )
        found = subprocess.run([*cli, "occupy", "gpu0", "--until", "1h30m",
                                "--controller", controller],
                               capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
        assert found.returncode == 0, found.stdout + found.stderr
        assert found.stdout.startswith("occupied gpu0 for ")
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest
    assert not token_file.parent.exists()  # removed on the way out
    assert processes_with(marker) == []
