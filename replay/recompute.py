"""What one step computes, recomputed with full instrumentation: the exact inputs a run's step
program was fed (faults applied) and separately jitted recomputations of its forward pass
(layers, or one block's intermediates), loss and gradients, for `refine_step`
(replay/bisect/refine.py).

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


# ------------------------------------------------------------------------ any other training loop

def _bits(x: Any) -> Any:
    """A leaf as comparable bits: a typed PRNG key by its key data, anything else as is."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def tree_leaves(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    """(PREFIX/leaf path, leaf bits) of a pytree, in tree order (the names run.step records)."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        p = jax.tree_util.keystr(path, simple=True, separator=".")
        out.append((f"{prefix}/{p}" if p else prefix, _bits(x)))
    return out


class _LoopSide:
    """One run of a training loop other than trainer/ (recorded through `replay.init`, replayed
    from its exported program, or a protocol replayable) at the divergent step.

    What every replayable gives: the run's own step on a copy of the state entering the step,
    so its example hashes, RNG words, recorded metrics (and fingerprints at the layer level) and
    its new state. With the user's code (a replay.Loop), also the step re-run with its taps
    collected (`replay.tap`: forward activations, gradients), as tensors, in a separately jitted
    program: both runs go through their own code the same way."""

    def __init__(self, replayer: Replayer, raw_state: Any, step: int):
        self.r, self.raw, self.step = replayer, raw_state, step
        self._cache: dict = {}

    def own(self) -> tuple[Any, Any]:
        """(new state, StepRecord) of the run's own step program."""
        if "own" not in self._cache:
            from replay.record.recorder import to_record

            rep = self.r.rep
            state, metrics, hashes = rep.step(_copy(self.raw), self.step)
            record = to_record(rep.schema, self.step, jax.device_get(metrics), np.asarray(hashes, np.uint64))
            self._cache["own"] = (state, record)
        return self._cache["own"]

    @property
    def schema(self) -> Any:
        return self.r.rep.schema

    def taps(self) -> list[tuple[str, str, Any]] | None:
        """[(name, kind, tree)] the step taps, recomputed with the user's code; None when the
        replay runs without it (an exported program) or the loop is not a replay.Loop."""
        if "taps" not in self._cache:
            self._cache["taps"] = self._recompute_taps()
        return self._cache["taps"]

    def step_and_inputs(self) -> tuple[Callable, tuple] | None:
        """(the user's step function, (a copy of the state entering the step, its batch)), or None
        when the replay runs without the user's code."""
        rep = self.r.rep
        program, loop = getattr(rep, "program", None), getattr(rep, "loop", None)
        fn = getattr(program, "fn", None)
        if fn is None or loop is None:
            return None
        return fn, (_copy(self.raw), rep.batch(self.step))

    def _recompute_taps(self) -> list[tuple[str, str, Any]] | None:
        from replay.code import call_user

        rep = self.r.rep
        program, loop = getattr(rep, "program", None), getattr(rep, "loop", None)
        fn = getattr(program, "fn", None)
        if fn is None or loop is None:
            return None
        from replay.record.taps import collecting

        kinds: list[tuple[str, str]] = []

        def instrumented(state: Any, batch: Any) -> tuple[list, Any]:
            with collecting() as taps:
                _, metrics = fn(state, batch)
            kinds[:] = [(name, kind) for name, kind, _ in taps]
            return [tree for _, _, tree in taps], metrics

        # An exception while tracing it is the user's step's: name their function, not this wrapper.
        instrumented.__module__, instrumented.__qualname__ = fn.__module__, getattr(fn, "__qualname__", "step")
        batch = rep.batch(self.step)
        trees, metrics = call_user(jax.jit(instrumented), _copy(self.raw), batch)
        out = [(name, kind, tree) for (name, kind), tree in zip(kinds, trees)]
        # Outputs that are neither scalar metrics nor per-example ones, as run.step records them.
        width = getattr(program, "batch", None)
        for path, x in jax.tree_util.tree_flatten_with_path(metrics)[0]:
            shape = np.shape(x)
            per_example = shape == (width,) and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
            if shape != () and not per_example:
                out.append((f"output/{jax.tree_util.keystr(path, simple=True, separator='/') or 'metric'}",
                            "output", x))
        return out
