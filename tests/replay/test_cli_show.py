"""`replay show` and the CLI conventions: one line on stderr and exit 2 for bad input,
tracebacks only with --debug, data on stdout, and never a write to the run directory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import traces
from replay.cli import show as show_module
from replay.cli.app import app
from replay.errors import UserError, user_error_code

SCHEMA = traces.Schema(
    examples_per_step=4,
    rng_words=2,
    metrics=(("loss", "loss"), ("grad_norm", "backward"), ("lr", "update")),
    tensors=(("block_00.out", "forward"), ("block_00.grad", "backward"), ("block_00.param", "update")),
)
MANIFEST = {
    "config": {"preset": "tiny", "seed": 7, "steps": 6, "model": {"n_layers": 1, "d_model": 8}},
    "environment": {"jax": "0.0-test", "backend": "cpu", "device_count": 1},
    "checkpoints": [0, 3, 6],
}


def _metrics(k: int) -> np.ndarray:
    # Values whose shortest float32 repr differs from the float64 one, a NaN and a -0.0.
    return np.array([2.3 / (k + 1), np.nan if k % 2 else 0.1, -0.0], dtype=np.float32)


def _record(k: int) -> traces.StepRecord:
    return traces.StepRecord(
        step=k,
        rng=np.array([k, 0xDEADBEEF], dtype=np.uint32),
        batch_hash=(k * 0x9E3779B97F4A7C15) % 2**64,
        example_hashes=np.arange(4, dtype=np.uint64) + k,
        metrics=_metrics(k),
    )


def make_run(path: Path, steps: int = 6, finish: bool = True) -> Path:
    run = traces.Run.create(path, SCHEMA, MANIFEST)
    w = run.writer()
    for k in range(steps):
        w.append(_record(k))
    run.finish() if finish else run.close()
    return path


def make_crashed_run(path: Path) -> tuple[Path, Path]:
    """A run whose writer died mid-record: no COMPLETE marker and a half-written last frame."""
    make_run(path, steps=5, finish=False)
    segment = sorted((path / "trace").glob("*.seg"))[-1]
    with open(segment, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x12\x34\x56\x78half-a-record")
    return path, segment


def tree_digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env=env or {"REPLAY_DEBUG": None})


def assert_one_error_line(result, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


# ------------------------------------------------------------------------------ good runs


def test_show_complete_run_table(tmp_path):
    run = make_run(tmp_path / "run")
    result = invoke("show", str(run))
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    out = result.stdout
    assert "complete" in out
    assert "0..5 (6 steps)" in out
    assert "0, 3, 6" in out  # checkpoints
    assert "loss, grad_norm, lr" in out
    assert "config.preset" in out and "tiny" in out
    assert "environment.backend" in out
    assert "last metrics (step 5)" in out
    last = _metrics(5)
    for v, bits in zip(last, last.view(np.uint32)):
        assert f"0x{int(bits):08x}" in out
        assert str(v) in out


def test_show_complete_run_json(tmp_path):
    run = make_run(tmp_path / "run")
    result = invoke("show", str(run), "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)  # one strict JSON object: NaN must not leak in
    assert data["status"] == "complete"
    assert data["format_version"] == traces.FORMAT_VERSION
    assert data["steps"] == {"start": 0, "end": 6, "last": 5, "count": 6}
    assert data["schema"]["metrics"] == ["loss", "grad_norm", "lr"]
    assert data["schema"]["tensors"] == 3
    assert data["schema"]["examples_per_step"] == 4
    assert data["checkpoints"] == [0, 3, 6]
    assert data["config"] == MANIFEST["config"]
    assert data["environment"] == MANIFEST["environment"]
    assert data["damage"] == [] and data["problem"] is None
    last = data["last_metrics"]
    assert last["step"] == 5
    written = _metrics(5)
    for m, v, bits in zip(last["metrics"], written, written.view(np.uint32)):
        assert m["bits"] == f"0x{int(bits):08x}"
        assert np.array(int(m["bits"], 16), dtype=np.uint32).view(np.float32) == v or np.isnan(v)
        if np.isfinite(v):
            assert np.float32(m["value"]).view(np.uint32) == bits  # the JSON value is exact
        else:
            assert m["value"] is None and m["repr"] == "nan"
    assert [m["repr"] for m in last["metrics"]][2] == "-0.0"


def test_show_lists_the_checkpoints_the_loops_own_manager_saved(tmp_path):
    # A run whose loop keeps its own checkpoints (a MaxText run with its checkpointing on: replay saved none)
    # lists them in run.json's loop_checkpoints as its launcher sees them saved; show names them and the folder.
    manifest = dict(MANIFEST, checkpoints=[], loop_checkpoints={"directory": "/data/mt/checkpoints", "steps": [0, 4, 1]})
    run = traces.Run.create(tmp_path / "run", SCHEMA, manifest)
    run.writer().append(_record(0))
    run.finish()
    data = json.loads(invoke("show", str(tmp_path / "run"), "--json").stdout)
    assert (data["checkpoints"], data["loop_checkpoints"]) == ([0, 1, 4], "/data/mt/checkpoints"), data
    table = invoke("show", str(tmp_path / "run")).stdout
    assert "0, 1, 4 (the loop's own, in /data/mt/checkpoints)" in " ".join(table.split()), table
    plain = json.loads(invoke("show", str(make_run(tmp_path / "plain")), "--json").stdout)
    assert (plain["checkpoints"], plain["loop_checkpoints"]) == ([0, 3, 6], None)


def test_show_running_run_is_a_snapshot(tmp_path):
    run = traces.Run.create(tmp_path / "run", SCHEMA, MANIFEST)
    try:
        w = run.writer()
        for k in range(3):
            w.append(_record(k))
        result = invoke("show", str(run.path), "--json")
    finally:
        run.close()
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["status"] == "running"
    assert "live process" in result.stderr


# ------------------------------------------------------------------------------ bad input


def test_show_missing_path(tmp_path):
    result = invoke("show", str(tmp_path / "no-such-run"))
    line = assert_one_error_line(result)
    assert "no-such-run" in line and "no such run" in line
    assert result.stdout == ""


def test_show_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = invoke("show", str(tmp_path))
    line = assert_one_error_line(result)
    assert "not a run" in line and "run.json" in line


def test_show_crashed_run(tmp_path):
    run, segment = make_crashed_run(tmp_path / "run")
    before = tree_digest(run)
    result = invoke("show", str(run))
    line = assert_one_error_line(result)
    assert "crashed" in line
    assert str(segment) in line  # names the file ...
    assert "after step 4" in line  # ... and the step
    assert f"replay train --resume {run}" in line
    assert "crashed" in result.stdout and "0..4 (5 steps)" in result.stdout  # the summary is still shown
    assert tree_digest(run) == before


def test_show_crashed_run_json(tmp_path):
    run, segment = make_crashed_run(tmp_path / "run")
    result = invoke("show", str(run), "--json")
    assert_one_error_line(result)
    data = json.loads(result.stdout)
    assert data["status"] == "crashed"
    assert data["steps"]["end"] == 5
    assert len(data["damage"]) == 1
    assert data["damage"][0]["path"] == str(segment) and data["damage"][0]["step"] == 5
    assert data["problem"] and "crashed" in data["problem"]


def test_show_newer_format_version(tmp_path):
    run = make_run(tmp_path / "run")
    manifest = json.loads((run / "run.json").read_text())
    manifest["format_version"] = 999
    (run / "run.json").write_text(json.dumps(manifest))
    line = assert_one_error_line(invoke("show", str(run)))
    assert "999" in line and "upgrade" in line


def test_show_damaged_complete_run(tmp_path):
    run = make_run(tmp_path / "run")
    segment = sorted((run / "trace").glob("*.seg"))[-1]
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0x10
    segment.write_bytes(bytes(data))
    result = invoke("show", str(run), "--verify")
    line = assert_one_error_line(result)
    assert "damaged" in line and str(segment) in line


def test_show_complete_run_with_truncated_trace(tmp_path):
    run = make_run(tmp_path / "run")
    segment = sorted((run / "trace").glob("*.seg"))[-1]
    os.truncate(segment, segment.stat().st_size - 3)
    result = invoke("show", str(run), "--json")
    line = assert_one_error_line(result)
    assert "damaged" in line and str(segment) in line
    data = json.loads(result.stdout)
    assert data["status"] == "damaged" and data["writer_status"] == "complete"
    assert data["steps"]["end"] == 5 and data["damage"][0]["step"] == 5


def test_debug_prints_traceback(tmp_path):
    missing = str(tmp_path / "missing")
    result = invoke("--debug", "show", missing)
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "RunNotFoundError" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    result = invoke("show", missing, env={"REPLAY_DEBUG": "1"})
    assert result.exit_code == 2 and "Traceback" in result.stderr


def test_unexpected_exception_is_reported_as_a_bug(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(show_module, "summarize", broken)
    line = assert_one_error_line(invoke("show", str(tmp_path)), code=3)
    assert "bug" in line and "--debug" in line and "ZeroDivisionError: boom" in line
    result = invoke("--debug", "show", str(tmp_path))
    assert result.exit_code == 3 and "Traceback" in result.stderr


def test_show_leaves_the_run_byte_identical(tmp_path):
    run = make_run(tmp_path / "run")
    before = tree_digest(run)
    for args in (["show", str(run)], ["show", str(run), "--json"], ["show", str(run), "--verify"]):
        assert invoke(*args).exit_code == 0
    assert tree_digest(run) == before


def test_user_errors_come_from_the_static_table():
    class MyError(ValueError):
        pass

    assert user_error_code(traces.NotARunError("x")) == 2
    assert user_error_code(UserError("x", 5)) == 5
    assert user_error_code(ValueError("x")) is None
    assert user_error_code(MyError("x")) is None  # not in the table: a bug, whatever ran before


def test_console_script_without_debug_has_no_traceback(tmp_path):
    script = Path(sys.executable).with_name("replay")
    exe = [str(script)] if script.exists() else [shutil.which("replay") or pytest.skip("replay console script not installed")]
    env = {k: v for k, v in os.environ.items() if k != "REPLAY_DEBUG"}
    proc = subprocess.run(exe + ["show", str(tmp_path / "missing")], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    run = make_run(tmp_path / "run")
    proc = subprocess.run(exe + ["show", str(run), "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"]["count"] == 6


def test_a_run_from_before_manifest_checksums_is_shown_only_when_trusted(tmp_path):
    from traces.run import write_json_atomic

    run = make_run(tmp_path / "run")
    manifest = json.loads((run / "run.json").read_text())
    for key in ("manifest_sha256", "trace_first_step"):  # what runs recorded before issue 10 lack
        manifest.pop(key)
    manifest["format_version"] = 1
    write_json_atomic(run / "run.json", manifest)
    result = invoke("show", str(run))
    assert result.exit_code == 2 and "--trust-unchecked-manifest" in result.stderr, result.output
    # Trusted, it is still refused: its trace segments say format_version 2, which always checksums run.json.
    result = invoke("--trust-unchecked-manifest", "show", str(run))
    assert result.exit_code == 2 and "its trace was written by format_version 2" in result.stderr, result.output


