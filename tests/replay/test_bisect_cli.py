"""`replay bisect` bad input: one line, exit 2; noise-only pairs exit 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from replay.cli.app import app
from traces import Run
from tests.traces.helpers import make_record, make_schema


def make_run(path: Path, schema, steps: int = 5, finish: bool = True) -> Path:
    run = Run.create(path, schema, {"config": {"synthetic": True}})
    w = run.writer()
    for k in range(steps):
        w.append(make_record(schema, k))
    run.finish() if finish else run.close()
    return path


def one_line_error(result, needle: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


@pytest.fixture
def schema():
    return make_schema()


def test_runs_of_different_models_are_refused(tmp_path, schema):
    other = make_schema()
    other = type(schema)(**{**other.__dict__, "tensors": other.tensors[:-1]})
    a, b = make_run(tmp_path / "a", schema), make_run(tmp_path / "b", other)
    one_line_error(CliRunner().invoke(app, ["bisect", str(a), str(b), "--no-refine"]), "different models")


def test_a_run_compared_with_itself_is_refused(tmp_path, schema):
    a = make_run(tmp_path / "a", schema)
    one_line_error(CliRunner().invoke(app, ["bisect", str(a), str(a)]), "same run")


def test_a_crashed_run_is_refused_unless_allowed(tmp_path, schema):
    a, b = make_run(tmp_path / "a", schema), make_run(tmp_path / "b", schema, finish=False)
    one_line_error(CliRunner().invoke(app, ["bisect", str(a), str(b), "--no-refine"]), "crashed")
    ok = CliRunner().invoke(app, ["bisect", str(a), str(b), "--no-refine", "--allow-incomplete", "--json"])
    assert ok.exit_code == 0, ok.output


def test_a_missing_run_is_refused(tmp_path, schema):
    a = make_run(tmp_path / "a", schema)
    one_line_error(CliRunner().invoke(app, ["bisect", str(a), str(tmp_path / "nope")]), "no such run")
