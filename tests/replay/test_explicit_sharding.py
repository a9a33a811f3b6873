"""A step under explicit sharding (`jax.make_mesh`'s default axis type in this JAX: each value's
type carries its sharding) records and replays bit for bit, with its code and without.

Before: recording raised JAX's ShardingTypeError from replay's own record packing (a per-example
metric split over the data axis cannot be concatenated with a replicated loss), and a with-code
replay fed numpy batches traced another program (types without the in_shardings the recorded
batches had) and was "measured only"."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import replay
from tests.cli_util import invoke

B, D = 8, 4
ROOT = Path(__file__).resolve().parents[2]


def _shardings():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))  # the default: explicit axes
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def batch_at(step: int) -> dict:
    rng = np.random.default_rng([3, step])
    return {"x": rng.normal(size=(B, D)).astype(np.float32), "y": rng.normal(size=(B,)).astype(np.float32)}


def init() -> dict:
    return jax.device_put({"w": jnp.linspace(-1.0, 1.0, D, dtype=jnp.float32)}, _shardings()[0])


def train_step(state: dict, batch: dict, lr: float) -> tuple[dict, dict]:
    def loss_fn(w):
        per = (batch["x"] @ w - batch["y"]) ** 2
        return jnp.mean(per), per

    (loss, per), grad = jax.value_and_grad(loss_fn, has_aux=True)(state["w"])
    replay.tap(grad, "grad")
    return {"w": state["w"] - lr * grad}, {"loss": loss, "example_loss": per}


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    replicated, data = _shardings()
    step = jax.jit(functools.partial(train_step, lr=config["lr"]), in_shardings=(replicated, data),
                   out_shardings=(replicated, replicated))
    return replay.Loop(step=step, batch_at=batch_at, init=init)


def record(path) -> None:
    loop = make({"lr": 0.1})
    run = replay.init(path, config={"lr": 0.1}, entrypoint=make, store_examples=True)
    step = run.step(batch_axis=0)(loop.step)
    _, data = _shardings()
    state = loop.init()
    for k in range(5):
        if k % 2 == 0:
            run.save(k, state)
        state, _ = step(state, jax.device_put(batch_at(k), data))  # fed sharded, as a multi-device loop does
    run.finish()


def _check(result_code: int, output: str) -> None:
    report = json.loads(output.strip().splitlines()[-1])
    assert result_code == 0 and report["all_bit_exact"] and report["replayed"] == 5, output[-2000:]
    assert report["contract"]["expect_bits"] and "with your code" in report["contract"]["line"], report["contract"]


def test_an_explicitly_sharded_step_records_and_replays_bit_for_bit(tmp_path):
    record(tmp_path / "run")
    result = invoke("run", str(tmp_path / "run"), "--steps", "0:4", "--json")  # this module is installed: its code
    _check(result.exit_code, result.stdout)


@pytest.mark.slow
def test_on_four_devices_the_replay_with_code_compiles_the_recorded_program(tmp_path):
    """On several devices the replayed numpy batches must take the step's in_shardings to trace the
    recorded program (one device hides it: every sharding there is the same)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "REPLAY_DEBUG")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    path = str(tmp_path / "run")
    done = subprocess.run([sys.executable, "-c", "import sys; from tests.replay.test_explicit_sharding import record; "
                           "record(sys.argv[1])", path], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "replay.cli.app", "run", path, "--steps", "0:4", "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    _check(done.returncode, done.stdout)
