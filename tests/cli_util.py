"""Helpers the CLI tests share: run a command in-process, check one-line errors, hash a run."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import click.testing
import typer.main

_built = None  # replay's click group, built from the typer app once per process


def _group():
    """A copy of replay's click group without the plugins' commands (its ReplayGroup adds them on
    first need, as in a fresh process, so a test that changes the plugins sees its own). typer's
    CliRunner builds the group from every command's signature on each invoke: ~17 ms of CPU of the
    18.6 ms a `replay show` of a missing run took (1.2 ms with the group kept), and the suite
    invokes over a thousand times (test_corruption.py alone over 600). A fresh build would make
    the same commands from the same registered functions; nothing of an invocation is kept on them."""
    global _built
    from replay.cli.app import app

    if _built is None:
        _built = typer.main.get_command(app)
    group = copy.copy(_built)
    group.commands = dict(_built.commands)
    group._plugins_added = False
    return group


def invoke(*args: str):
    """`replay ARGS` in this process, as the console script runs it; REPLAY_DEBUG unset so a
    developer's environment cannot add tracebacks to what the tests read. typer's CliRunner is
    click's with the app turned into a click group first; the kept group (_group) is given to
    click's runner directly."""
    return click.testing.CliRunner().invoke(_group(), list(args), env={"REPLAY_DEBUG": None})


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
