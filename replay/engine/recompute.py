"""What one step computes, recomputed with full instrumentation, for `refine_step`
(replay/bisect/refine.py) and the cross-framework distance (replay/bisect/cross_distance.py).

A loop gives it through its replayable's optional capability `recompute_step(state, step)`,
which returns a `StepRecomputation` (the contract below; the trainer's is
trainer/recompute.py). The recomputation is a separate program from the training step, so its
bits need not equal the step's own -- but both runs go through the same program, so what differs
between them is what their inputs and configs make differ. A loop without the capability is
refined by `_LoopSide` (its own step re-run, its taps recomputed with its code).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, Sequence

import jax
import numpy as np

from replay.engine.replayer import Replayer, ReplayUnavailable, _copy
from replay.engine.code import call_user
from replay.record.taps import collecting

CAPABILITY = "recompute_step"


# ------------------------------------------------------------------------ what one step computes

class StepRecomputation(Protocol):
    """What `replayable.recompute_step(state, step)` returns: step `step` of the run, from `state`
    (the state entering it, as restore/step give it, before anything the run injects), with
    everything it computes available by name. Tensors stay where they live (device arrays);
    values are computed on first use and kept.

    Names: `param_names` are dotted paths into `params()` and into the gradient tree
    (replay.record.names.get_path), in the order the trace records parameters; `layer_names` are
    the keys of `layers()`, in execution order (the trace's forward fields); `block_names` are the
    layers that have intermediates, each with `intermediate_names(block)` in execution order (the
    keys of `intermediates(block)`); `loss_names` are the keys of `loss_and_grads()[0]`, in causal
    order."""

    hashes: np.ndarray  # uint64 [B]: the per-example hashes of the batch the step is fed, global order
    program: str  # which program the step ran: "the run's own", or what the run injected instead
    param_names: Sequence[str]
    layer_names: Sequence[str]
    block_names: Sequence[str]
    loss_names: Sequence[str]

    def rng(self) -> np.ndarray: ...  # uint32 words of the key the step draws from

    def params(self) -> Any: ...  # the parameter tree the step is fed

    def params_of(self, state: Any) -> Any: ...  # the parameter tree of a state of the run (the step's result)

    def opt_state(self) -> Any: ...  # the optimizer state the step is fed

    def layers(self) -> dict[str, Any]: ...  # {layer name: forward output}

    def intermediate_names(self, block: str) -> Sequence[str]: ...

    def intermediates(self, block: str) -> dict[str, Any]: ...  # {intermediate name: tensor} inside `block`

    def loss_and_grads(self) -> tuple[dict[str, Any], Any]: ...  # ({loss name: value}, gradient tree)

    def tensors(self, names: Iterable[str], after: Any) -> dict[str, np.ndarray]:
        """{name: host array} of the tensors the trace records under `names` at this step (those
        the loop records; others left out), recomputed; `after` is the state the step returned,
        for what the trace records after the update."""
        ...


def recomputes(replayer: Replayer) -> bool:
    """Whether the run's loop provides `recompute_step` (refine_step, or refine_loop_step)."""
    return getattr(replayer.rep, CAPABILITY, None) is not None


class _Side:
    """One run at the divergent step: its recomputation (`rc`, a StepRecomputation) and the run's
    own step on a copy of the state entering it (`after`)."""

    def __init__(self, replayer: Replayer, raw_state: Any, step: int):
        recompute = getattr(replayer.rep, CAPABILITY, None)
        if recompute is None:
            raise ReplayUnavailable(f"{replayer.label}: the run's loop does not provide {CAPABILITY}(state, step) "
                                    "(a step recomputed with its intermediates, replay/engine/recompute.py), which layer "
                                    "refinement needs")
        self.r, self.raw, self.step = replayer, raw_state, step
        self.rc: StepRecomputation = recompute(raw_state, step)
        self._cache: dict = {}

    def after(self) -> tuple[Any, dict, np.ndarray]:
        """(state after the step, metrics, hashes): the run's own compiled step, on a copy of its state."""
        if "after" not in self._cache:
            state, metrics, hashes = self.r.rep.step(_copy(self.raw), self.step)
            self._cache["after"] = (state, jax.device_get(metrics), hashes)
        return self._cache["after"]


# ------------------------------------------------------------------------ a loop without recompute_step

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
    """One run of a loop without `recompute_step` (recorded through `replay.init`, replayed
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
        rep = self.r.rep
        program, loop = getattr(rep, "program", None), getattr(rep, "loop", None)
        fn = getattr(program, "fn", None)
        if fn is None or loop is None:
            return None

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
