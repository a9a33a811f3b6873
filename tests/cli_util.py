"""Helpers the CLI tests share: run a command in-process, check one-line errors, hash a run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from typer.testing import CliRunner


def invoke(*args: str):
    from replay.cli.app import app

    return CliRunner().invoke(app, list(args))


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


def assert_one_line_error(result, *needles: str) -> None:
    """Exit 2, one `error: ...` line on stderr holding every needle, no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
