"""Runs a bench module in a child process with 8 virtual CPU devices (set before JAX starts, which
a process that has imported JAX cannot do) and returns its last stdout line: the JSON."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(module: str, *args: str) -> str:
    """The last stdout line of `python -m module *args` on 8 devices; a failing child's stderr
    tail is passed on and its exit code is this process's."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(done.returncode)
    return done.stdout.strip().splitlines()[-1]
