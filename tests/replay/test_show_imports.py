"""`replay show` starts without JAX (issue 12: show within a second at 1.4M steps, where JAX's
import alone took longer than the budget's second) and without pydantic (typer 0.29 coerces every
parameter through it: ~0.12 s of every command's start-up; pyproject.toml keeps typer below it).
Only a fresh process can tell."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.traces.helpers import BLOCK_JAX, make_record, make_schema
from traces import Run

SHOW_WITHOUT_JAX = BLOCK_JAX + r"""
import runpy
sys.argv = ["replay", "show", sys.argv[1], "--json"]
try:
    runpy.run_module("replay.cli.app", run_name="__main__")
except SystemExit as e:
    code = e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"jax", "jaxlib", "orbax", "optax", "trainer", "matplotlib",
                                                  "pydantic"})
print("exit", code, "heavy", heavy, file=sys.stderr)
"""


@pytest.mark.slow
@pytest.mark.parametrize("layer", [False, True], ids=["step-level", "layer-level"])
def test_show_imports_no_jax(tmp_path, layer):
    schema = make_schema(layer=layer)
    run = Run.create(tmp_path / "run", schema, {"config": {"steps": 4}})
    writer = run.writer()
    for k in range(4):
        writer.append(make_record(schema, k))
    run.finish()
    done = subprocess.run([sys.executable, "-c", SHOW_WITHOUT_JAX, str(tmp_path / "run")], capture_output=True,
                          text=True)
    assert done.stderr.strip().splitlines()[-1] == "exit 0 heavy []", done.stderr[-2000:]
    assert np.isfinite(__import__("json").loads(done.stdout)["last_metrics"]["metrics"][0]["value"])
