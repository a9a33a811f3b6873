"""The trainer's step, recomputed with every intermediate: what `recompute_step` (the model side
of the loop protocol, trainer/replay_model.py) returns for refine (replay/bisect/refine.py) and the
cross-framework distance (replay/bisect/cross_distance.py). It implements
replay.engine.recompute.StepRecomputation; its contract is documented there.

The exact inputs a run's step program was fed (faults applied) and separately jitted
recomputations of its forward pass (layers, or one block's intermediates), loss and gradients.
The recomputation is a separate jitted program from the training step (full batch; a
mesh-invariant run's microbatched gradients are recomputed the plain way), so its bits need not
equal the step's own -- but both runs go through the same program, so what differs between them
is what their inputs and configs make differ.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from replay.record.names import get_path
from replay.errors import ReplayUnavailable
from trainer import model, rng
from trainer.config import CheckpointConfig, Config, TraceConfig
from trainer.step import loss_fn

LOSS_NAMES = ("loss", "z_loss", "example_loss")


@dataclass
class StepInputs:
    """What a run's step program was fed: state (faults applied), batch, and its config."""

    state: Any
    batch: dict  # {"inputs", "targets"}: int32[B, L] on the mesh
    hashes: np.ndarray  # per-example hashes, global order
    cfg: Config  # of the program that ran (a layer-bf16 fault's faulty config)
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


def _static_cfg(cfg: Config) -> Config:
    """The config without what the step's math does not read, so runs of different lengths or
    recording levels share one compiled recomputation."""
    return dataclasses.replace(cfg, steps=0, checkpoint=CheckpointConfig(), trace=TraceConfig())


def _step_key(key_data: jax.Array, step: jax.Array) -> jax.Array:
    # As trainer/step.py's train_step derives it: fold the step counter into the base key.
    return rng.step_key(jax.random.wrap_key_data(key_data, impl="threefry2x32"), step)


@jax.jit
def _rng_words(key_data: jax.Array, step: jax.Array) -> jax.Array:
    return rng.key_words(_step_key(key_data, step))


@functools.partial(jax.jit, static_argnames=("cfg", "capture"))
def _forward(params: Any, inputs: jax.Array, key_data: jax.Array, step: jax.Array, *, cfg: Any, capture: Any) -> Any:
    key = _step_key(key_data, step) if cfg.model.dropout > 0 else None  # as loss_fn does
    return model.apply(cfg.model, params, inputs, dropout_key=key, capture=capture)[1]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _loss_and_grads(params: Any, inputs: jax.Array, targets: jax.Array, key_data: jax.Array, step: jax.Array,
                    *, cfg: Any) -> tuple[dict, Any]:
    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, cfg, inputs, targets,
                                                                 _step_key(key_data, step), False)
    return {"loss": aux["loss"], "z_loss": aux["z_loss"], "example_loss": aux["example_loss"]}, grads


class TrainerRecomputation:
    """One trainer step at `step` from `state` (the state entering it, before faults): its inputs,
    and what it computes, computed lazily and kept (replay.engine.recompute.StepRecomputation)."""

    loss_names = LOSS_NAMES

    def __init__(self, built: Any, state: Any, step: int):
        self.inp = step_inputs(built, state, step)
        self.cfg = _static_cfg(self.inp.cfg)
        self.hashes = self.inp.hashes
        self.program = "faulty (layer-bf16)" if self.inp.faulty_program else "the run's own"
        self.param_names = list(model.param_names(self.cfg.model))
        self.layer_names = list(model.layer_names(self.cfg.model))
        self.block_names = list(model.block_names(self.cfg.model))
        self._cache: dict = {}

    def _args(self) -> tuple:
        s = self.inp.state
        return s.key, s.step

    def rng(self) -> np.ndarray:
        return np.asarray(_rng_words(*self._args()))

    def params(self) -> Any:
        return self.inp.state.params

    def params_of(self, state: Any) -> Any:
        return state.params

    def opt_state(self) -> Any:
        return self.inp.state.opt_state

    def layers(self) -> dict:
        if "layers" not in self._cache:
            self._cache["layers"] = _forward(self.inp.state.params, self.inp.batch["inputs"], *self._args(),
                                             cfg=self.cfg, capture="layers")
        return self._cache["layers"]

    def intermediate_names(self, block: str) -> list[str]:
        return model.block_capture_names(self.cfg.model, block)

    def intermediates(self, block: str) -> dict:
        if ("block", block) not in self._cache:
            self._cache[("block", block)] = _forward(self.inp.state.params, self.inp.batch["inputs"], *self._args(),
                                                     cfg=self.cfg, capture=block)
        return self._cache[("block", block)]

    def loss_and_grads(self) -> tuple[dict, Any]:
        if "grads" not in self._cache:
            self._cache["grads"] = _loss_and_grads(self.inp.state.params, self.inp.batch["inputs"],
                                                   self.inp.batch["targets"], *self._args(), cfg=self.cfg)
        return self._cache["grads"]

    def tensors(self, names: Iterable[str], after: Any) -> dict[str, np.ndarray]:
        """The trainer's recorded tensors among `names` (trainer.step.tensor_schema): forward
        layers, `grad/NAME` and `param/NAME` (the latter from `after`, the state the step returned)."""
        names = set(names)
        out: dict[str, np.ndarray] = {}
        layers = self.layers()
        for n in names:
            if n in layers:
                out[n] = np.asarray(jax.device_get(layers[n]))
        _, grads = self.loss_and_grads()
        for n in names:
            if n.startswith("grad/"):
                out[n] = np.asarray(jax.device_get(get_path(grads, n.removeprefix("grad/"))))
            elif n.startswith("param/"):
                out[n] = np.asarray(jax.device_get(get_path(after.params, n.removeprefix("param/"))))
        return out


# ------------------------------------------------------------------------ evaluation (compare --eval)

@functools.lru_cache(maxsize=8)
def _loss_program(cfg: Config) -> Any:
    """The jitted per-row eval loss for `cfg` (one per config: a pair's later compares reuse its
    compiled programs)."""
    return jax.jit(lambda p, x, y: loss_fn(p, cfg, x, y, None, False)[1]["example_loss"])


def eval_losses(cfg: Config, params: Any, rows: np.ndarray) -> np.ndarray:
    """float32 [N]: each token row's mean next-token cross-entropy under `params`, without z-loss
    or dropout, `cfg.data.global_batch_size` rows at a time."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.0))
    fn = _loss_program(cfg)
    batch = cfg.data.global_batch_size
    out = [np.asarray(fn(params, jnp.asarray(chunk[:, :-1]), jnp.asarray(chunk[:, 1:])))
           for chunk in (rows[i:i + batch] for i in range(0, len(rows), batch))]
    return np.concatenate(out).astype(np.float32)
