"""Runs a bench module in a child process with 8 virtual CPU devices (set before JAX starts, which
a process that has imported JAX cannot do) and returns its last stdout line: the JSON.

Errors are one line on stderr, as everywhere: `bad_input` in the parent (checked before the child
starts) and in the child's worker (exit 2); a child that fails otherwise is named with its last
stderr line (its exception) and exit 3, its traceback kept out of the output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]


def bad_input(msg: str) -> NoReturn:
    """`error: msg` on stderr, exit 2."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def run(module: str, *args: str) -> str:
    """The last stdout line of `python -m module *args` on 8 devices; a failing child's error is
    passed on as one line with its exit code (2, bad input) or 3 (anything else)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        last = lines[-1].strip() if lines else f"exited with code {done.returncode}"
        if done.returncode == 2 and last.startswith("error: "):
            print(last, file=sys.stderr)
            raise SystemExit(2)
        print(f"error: {module} failed in its 8-device child process: {last}", file=sys.stderr)
        raise SystemExit(3)
    return done.stdout.strip().splitlines()[-1]
