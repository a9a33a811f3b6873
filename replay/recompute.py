"""What one step computes, recomputed with full instrumentation: the exact inputs a run's step
program was fed (faults applied) and separately jitted recomputations of its forward pass
(layers, or one block's intermediates), loss and gradients, for `refine_step`
(replay/refine.py).

The recomputation is a separate jitted program from the training step (full batch; a
mesh-invariant run's microbatched gradients are recomputed the plain way), so its bits need
not equal the step's own -- but both runs go through the same program, so what differs
between them is what their inputs and configs make differ.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from replay.replayer import Replayer, ReplayUnavailable, _copy


# ------------------------------------------------------------------------ what one step computes

@dataclass
class StepInputs:
    """What a run's step program was fed: state (faults applied), batch, and its config."""

    state: Any
    batch: dict  # {"inputs", "targets"}: int32[B, L] on the mesh
    hashes: np.ndarray  # per-example hashes, global order
    cfg: Any  # trainer Config of the program that ran (a layer-bf16 fault's faulty config)
    faulty_program: bool


class _Capture:
    """Stands in for Built.compiled: records what run_step feeds its program, runs nothing."""

    def __init__(self, seen: dict, faulty: bool):
        self.seen, self.faulty = seen, faulty

    def __getitem__(self, level: str) -> Callable:
        def program(state: Any, batch: dict) -> tuple[Any, dict]:
            self.seen.update(state=state, batch=batch, faulty=self.faulty, level=level)
            return state, {}

        return program


def step_inputs(built: Any, state: Any, step: int) -> StepInputs:
    """Exactly what `built.run_step(state, step)` feeds its compiled program -- faults applied
    (bitflip, skip-opt-restore, dropout-key-reuse, data-repeat, ...) -- without running it:
    run_step is called on a shallow copy of `built` whose programs only record their input."""
    seen: dict = {}
    probe = copy.copy(built)
    probe.compiled, probe.compiled_faulty = _Capture(seen, False), _Capture(seen, True)
    _, _, hashes = probe.run_step(state, step)
    if "state" not in seen:
        raise ReplayUnavailable("the step did not call its program; cannot recompute it")
    cfg = built.cfg
    if seen["faulty"] and built.faults:
        cfg = built.faults.model_cfg(step) or cfg
    return StepInputs(seen["state"], seen["batch"], np.asarray(hashes, np.uint64), cfg, bool(seen["faulty"]))


def _static_cfg(cfg: Any) -> Any:
    """The config without what the step's math does not read, so runs of different lengths or
    recording levels share one compiled recomputation."""
    from trainer.config import CheckpointConfig, TraceConfig

    return dataclasses.replace(cfg, steps=0, checkpoint=CheckpointConfig(), trace=TraceConfig())


def _step_key(key_data: jax.Array, step: jax.Array) -> jax.Array:
    # As trainer/step.py's train_step derives it: fold the step counter into the base key.
    from trainer import rng

    return rng.step_key(jax.random.wrap_key_data(key_data, impl="threefry2x32"), step)


@jax.jit
def _rng_words(key_data: jax.Array, step: jax.Array) -> jax.Array:
    from trainer import rng

    return rng.key_words(_step_key(key_data, step))


@functools.partial(jax.jit, static_argnames=("cfg", "capture"))
def _forward(params: Any, inputs: jax.Array, key_data: jax.Array, step: jax.Array, *, cfg: Any, capture: Any) -> Any:
    from trainer import model

    key = _step_key(key_data, step) if cfg.model.dropout > 0 else None  # as loss_fn does
    return model.apply(cfg.model, params, inputs, dropout_key=key, capture=capture)[1]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _loss_and_grads(params: Any, inputs: jax.Array, targets: jax.Array, key_data: jax.Array, step: jax.Array,
                    *, cfg: Any) -> tuple[dict, Any]:
    from trainer.step import loss_fn

    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, cfg, inputs, targets,
                                                                 _step_key(key_data, step), False)
    return {"loss": aux["loss"], "z_loss": aux["z_loss"], "example_loss": aux["example_loss"]}, grads


class _Side:
    """One run at the divergent step: its inputs, and what its step computes, computed lazily."""

    def __init__(self, replayer: Replayer, raw_state: Any, step: int):
        self.r = replayer
        self.raw = raw_state
        self.step = step
        self.inp = step_inputs(replayer.built, raw_state, step)
        self.cfg = _static_cfg(self.inp.cfg)
        self._cache: dict = {}

    def _args(self) -> tuple:
        s = self.inp.state
        return s.key, s.step

    def rng(self) -> np.ndarray:
        return np.asarray(_rng_words(*self._args()))

    def params(self) -> Any:
        return self.inp.state.params

    def layers(self) -> dict:
        if "layers" not in self._cache:
            self._cache["layers"] = _forward(self.inp.state.params, self.inp.batch["inputs"], *self._args(),
                                             cfg=self.cfg, capture="layers")
        return self._cache["layers"]

    def block(self, name: str) -> dict:
        if ("block", name) not in self._cache:
            self._cache[("block", name)] = _forward(self.inp.state.params, self.inp.batch["inputs"], *self._args(),
                                                    cfg=self.cfg, capture=name)
        return self._cache[("block", name)]

    def loss_and_grads(self) -> tuple[dict, Any]:
        if "grads" not in self._cache:
            self._cache["grads"] = _loss_and_grads(self.inp.state.params, self.inp.batch["inputs"],
                                                   self.inp.batch["targets"], *self._args(), cfg=self.cfg)
        return self._cache["grads"]

    def after(self) -> tuple[Any, dict]:
        """(state after the step, metrics): the run's own compiled step, on a copy of its state."""
        if "after" not in self._cache:
            state, metrics, hashes = self.r.rep.step(_copy(self.raw), self.step)
            self._cache["after"] = (state, jax.device_get(metrics), hashes)
        return self._cache["after"]
