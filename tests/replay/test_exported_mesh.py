"""A step recorded over several devices (a batch NamedSharding over a mesh of every device, a
replicated state holding a typed key, a donated jax.jit step, as examples/linen_lm.py's) is
exported with its shardings and replays bit-exactly from the exported program on the same device
count; on another count the replay is refused in one line naming both (exit 2). Before, a
multi-device export was always refused at replay. The device count is fixed when JAX starts, so
the recording and the two-device replay run in a fresh process (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICES, STEPS, BUMP = 2, 8, 5
MISSING = "_replay_no_such_module_:make"


def _record(path: Path, bump: int) -> Path:
    """A linear model whose learning rate doubles at step `bump` (-1: never), dropout from a key."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import replay

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows, replicated = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())

    @jax.jit
    def step(state, batch):
        key, sub = jax.random.split(state["key"])
        keep = jax.random.bernoulli(sub, 0.9, batch["y"].shape)

        def loss_fn(w):
            example_loss = jnp.mean(jnp.where(keep, jnp.square(batch["x"] @ w - batch["y"]), 0.0), axis=-1)
            return jnp.mean(example_loss), example_loss

        (loss, example_loss), grad = jax.value_and_grad(loss_fn, has_aux=True)(state["w"])
        lr = jnp.where(state["step"] == bump, 0.2, 0.1)
        new = {"key": key, "step": state["step"] + 1, "w": state["w"] - lr * grad}
        return new, {"loss": loss, "example_loss": example_loss}

    step = jax.jit(step.__wrapped__, donate_argnums=0)
    run = replay.init(path, config={"bump": bump}, entrypoint=MISSING, store_examples=True)
    wrapped = run.step(step)
    state = jax.device_put({"key": jax.random.key(0), "step": jnp.zeros((), jnp.int32),
                            "w": jnp.zeros((4, 1), jnp.float32)}, replicated)
    for k in range(STEPS):
        if k % 3 == 0:
            run.save(k, state)
        g = np.random.default_rng([7, k])
        host = {"x": g.integers(-4, 5, (8, 4)).astype(np.float32), "y": g.integers(-4, 5, (8, 1)).astype(np.float32)}
        state, _ = wrapped(state, jax.device_put(host, rows))
    run.finish()
    return path


def _child(root: str) -> None:
    """In a process of DEVICES devices: record a clean and a bumped run, replay from the exported
    program, and against the bumped run's trace; print what the parent checks, as JSON."""
    import shutil

    import jax
    from typer.testing import CliRunner

    from replay.cli.app import app

    root_path = Path(root)
    clean, bumped = _record(root_path / "clean", -1), _record(root_path / "bumped", BUMP)
    same = CliRunner().invoke(app, ["run", str(clean), "--steps", "4:7", "--json"])
    mixed = root_path / "mixed"
    shutil.copytree(clean, mixed)
    shutil.rmtree(mixed / "trace")
    shutil.copytree(bumped / "trace", mixed / "trace")
    other = CliRunner().invoke(app, ["run", str(mixed), "--steps", "4:7", "--json"])
    print(json.dumps({"devices": jax.device_count(), "same": [same.exit_code, same.stdout, same.stderr],
                      "other": [other.exit_code, other.stdout, other.stderr]}))


@pytest.mark.slow
def test_a_multi_device_step_replays_on_its_device_count_and_is_refused_on_another(tmp_path):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "JAX_PLATFORMS": "cpu"}
    child = subprocess.run([sys.executable, "-c", f"from tests.replay.test_exported_mesh import _child; "
                            f"_child({str(tmp_path)!r})"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=500)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["devices"] == DEVICES
    code, stdout, stderr = out["same"]
    assert code == 0, stderr
    j = json.loads(stdout)
    assert j["all_bit_exact"] and (j["checkpoint"], j["replayed"], j["bit_exact"]) == (3, 4, 4), j
    assert j["notes"][0].startswith("replayed from the exported program") and j["contract"]["expect_bits"]
    code, stdout, stderr = out["other"]  # the comparison still sees a difference
    assert code == 1, stderr
    first = json.loads(stdout)["first_mismatch"]
    assert first["step"] == BUMP and first["fields"][0]["kind"] == "update", first

    from traces import Run

    ex = Run.open(tmp_path / "clean").manifest["exported"]
    assert "error" not in ex and ex["devices"] == DEVICES
    assert (ex["mesh"]["axes"], ex["mesh"]["shape"]) == (["data"], [DEVICES])
    assert [s for s in ex["state"] if "key" in s] == [{"path": "key", "dtype": "uint32", "shape": [2],
                                                        "key": "threefry2x32"}]

    from typer.testing import CliRunner

    from replay.cli.app import app

    import jax

    assert jax.device_count() != DEVICES  # this process: the other count
    result = CliRunner().invoke(app, ["run", str(tmp_path / "clean"), "--steps", "4:7"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert f"exported for {DEVICES} devices" in lines[0] and f"this process has {jax.device_count()}" in lines[0]
