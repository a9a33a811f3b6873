"""The trainer's step program for a 1-device run, lowered by the loop's own `mesh.lower_step`, for
tests that step the trainer by hand: they then compile the very programs the trainer's runs in
other test files compile (the same config and level give the same HLO), which the session's
compilation cache (tests/conftest.py) compiles once for all of them. Calling the jitted step on
arrays not yet placed lowers another program (measured: a third compile)."""

from __future__ import annotations

import jax

from trainer import mesh as meshlib


def loop_step(cfg, level: str):
    """step(state, batch) -> (state, metrics): the loop's compiled program at trace `level`,
    placing its arguments as the loop does. The state passed in is donated."""
    mesh = meshlib.make_mesh(cfg.mesh)
    lowered, shardings, batch_sharding, _ = meshlib.lower_step(cfg, level, mesh)
    compiled = lowered.compile()
    return lambda state, batch: compiled(jax.device_put(state, shardings), jax.device_put(batch, batch_sharding))
