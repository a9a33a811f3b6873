"""Helpers the CLI tests share: run a command in-process, check one-line errors, hash a run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from typer.testing import CliRunner


def invoke(*args: str):
    """`replay ARGS` in this process, as the console script runs it; REPLAY_DEBUG unset so a
    developer's environment cannot add tracebacks to what the tests read."""
    from replay.cli.app import app

    return CliRunner().invoke(app, list(args), env={"REPLAY_DEBUG": None})


def dir_digest(path: Path) -> str:
    """sha256 over every path and file's bytes under `path`: equal digests mean nothing changed."""
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def last_json(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_error_line(result, code: int, *needles: str) -> str:
    """Exit `code`, exactly one `error: ...` line on stderr holding every needle, no traceback;
    returns the line."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def assert_one_line_error(result, *needles: str) -> str:
    """Exit 2 (bad input), one `error: ...` line on stderr holding every needle, no traceback."""
    return assert_error_line(result, 2, *needles)
