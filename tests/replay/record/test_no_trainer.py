"""The recording API depends on nothing in trainer/ (DESIGN.md, "Packages": traces <- replay <- trainer).

A fresh process is needed: in the test session the trainer is already imported by other tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Imports every module of replay/record, then records two steps with a checkpoint (the
# manifest's environment, the program hash, the recorder, a state fingerprint, orbax).
_RECORD = textwrap.dedent("""
    import importlib, pkgutil, sys
    import replay.record

    def trainer_modules():
        return sorted(m for m in sys.modules if m == "trainer" or m.startswith("trainer."))

    for info in pkgutil.iter_modules(replay.record.__path__):
        importlib.import_module(f"replay.record.{info.name}")
    assert not trainer_modules(), ("importing replay.record", trainer_modules())

    import jax, jax.numpy as jnp, numpy as np
    import replay

    @jax.jit
    def step(state, batch):
        loss = jnp.mean((batch["x"] @ state["w"]) ** 2)
        return {"w": state["w"] * 0.5}, {"loss": loss}

    run = replay.init(sys.argv[1], config={"lr": 0.5}, entrypoint="tinyloop:make")  # never imported here
    wrapped = run.step(batch_axis=0)(step)
    state = {"w": jnp.ones((3, 2), jnp.float32)}
    for k in range(2):
        if k == 0:
            run.save(k, state)
        state, _ = wrapped(state, {"x": np.full((4, 3), k, np.float32)})
    run.finish()
    assert not trainer_modules(), ("recording through replay.init", trainer_modules())
    print("recorded without trainer")
""")


@pytest.mark.slow
def test_recording_through_the_api_imports_nothing_from_trainer(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", _RECORD, str(tmp_path / "run")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "recorded without trainer" in r.stdout
    from traces import Run

    run = Run.open(tmp_path / "run")
    assert run.status == "complete" and run.trace.end == 2 and run.manifest["checkpoint_fingerprints"]
