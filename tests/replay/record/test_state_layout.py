"""The state's shardings are part of the recording (run.json "state_layout", replay/record/state_layout.py),
and a with-code replay whose program differs because its Loop gives the state another layout says
so in the contract line, naming the leaf (issue 32, trap 3: before, "measured only: program_hash
differ" with no reason given).

The loop trains a state placed with a NamedSharding over a one-device mesh (as `jax.device_put(init(),
NamedSharding(mesh, P()))` does); `make` declares `abstract_state` on one device when the config says
so, which on one device too compiles another program."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import replay
from replay.record.state_layout import describe, first_difference
from tests.cli_util import invoke
from tests.replay.test_explicit_sharding import D, batch_at, train_step  # its loop, on Auto axes here


def _shardings():
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def init() -> dict:
    return jax.device_put({"w": jnp.linspace(-1.0, 1.0, D, dtype=jnp.float32)}, _shardings()[0])


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    step = jax.jit(functools.partial(train_step, lr=config["lr"]))
    if config["one_device"]:  # the layout eval_shape of a plain init gives: not what training had
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return replay.Loop(step=step, batch_at=batch_at,
                           abstract_state={"w": jax.ShapeDtypeStruct((D,), jnp.float32, sharding=one)})
    return replay.Loop(step=step, batch_at=batch_at, init=init)


def _record(path, one_device: bool) -> None:
    config = {"lr": 0.1, "one_device": one_device}
    run = replay.init(path, config=config, entrypoint=make)
    step = run.step(batch_axis=0)(make(config).step)
    state = init()
    for k in range(4):
        if k % 2 == 0:
            run.save(k, state)
        state, _ = step(state, jax.device_put(batch_at(k), _shardings()[1]))
    run.finish()


def _contract(path) -> tuple[int, dict]:
    result = invoke("run", str(path), "--steps", "1:3", "--json")
    return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1])


def test_the_recorded_layout_and_a_replay_that_keeps_it(tmp_path):
    _record(tmp_path / "kept", one_device=False)
    assert json.loads((tmp_path / "kept" / "run.json").read_text())["state_layout"] == {"w": "P() over data=1"}
    code, report = _contract(tmp_path / "kept")
    assert code == 0 and report["all_bit_exact"] and report["contract"]["expect_bits"], report["contract"]


def test_a_replay_on_another_layout_names_the_leaf_in_the_contract_line(tmp_path):
    _record(tmp_path / "moved", one_device=True)
    _, report = _contract(tmp_path / "moved")
    line = report["contract"]["line"]
    assert not report["contract"]["expect_bits"] and line.startswith("measured only"), line
    assert "program_hash (the state's layout differs: w recorded P() over data=1, here one device)" in line, line


def test_first_difference_counts_the_other_leaves_and_ignores_unknown_sides():
    recorded = {"a": "one device", "b": "P() over data=4", "c": "P('data',) over data=4"}
    here = {"a": "one device", "b": "one device", "c": "one device"}
    assert first_difference(recorded, here) == "the state's layout differs: b recorded P() over data=4, here one device " \
                                               "(and 1 more leaves)"
    assert first_difference(recorded, dict(recorded)) is None
    assert first_difference(None, here) is None and first_difference(recorded, None) is None
    assert describe({"x": jax.ShapeDtypeStruct((2,), jnp.float32)}) == {"x": "unplaced"}
