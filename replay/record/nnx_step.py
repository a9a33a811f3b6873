"""`run.nnx_step`: record a Flax NNX step written in place, as the NNX tutorials write it.

    @nnx.jit
    def train_step(model, optimizer, metrics, batch):   # mutates its graph nodes, returns nothing
        ...
    step = run.nnx_step(train_step)                    # called exactly as before:
    step(model, optimizer, metrics, batch)             # model, optimizer, metrics updated in place

The step's arguments are graph nodes followed by the batch (the last argument). Recording
turns the call into the functional step every other part of replay knows, `(state, batch) ->
(state, metrics)`: the state is `nnx.split` of the nodes that are not metrics (the Variables
entering the step: parameters, BatchNorm statistics, the Dropout stream, the optimizer); the
user's Python function (unwrapped from `nnx.jit`, so `replay.tap` works inside it) runs on
them merged inside the recorded program, and what it wrote back is `nnx.update`d into the
caller's objects afterwards, so the caller's objects end as `nnx.jit` would have left them.

Metrics (`nnx.MultiMetric`, `nnx.metrics.Average`, `Accuracy`) are not part of the recorded
state. Inside the program the step updates a reset copy of them, so the step's own values
(`compute()` of the copy: this batch's mean loss, accuracy) are recorded as the trace's metrics,
bit-independent of what the accumulators held; the copy's totals are then added to the caller's
accumulators, which for these metrics is exactly the in-place update (total + (0 + x) == total
+ x). So `metrics.reset()` between steps, as the tutorials do every epoch, edits nothing replay
compares. A metric whose state does not add up (Welford) is refused in one line; return such a
value from the step instead (a returned dict of arrays, or a scalar named "loss", is recorded
too, and handed back to the caller).

Replay rebuilds the same step from `replay.Loop(nnx_step=train_step, nodes=lambda:
create(cfg), ...)` (replay/record/loop.py): `nodes()` builds the graph nodes the step takes, in
its order; the Loop's `step` and `init` are this module's functional form of them.

Cost per call: one `nnx.split` of the nodes on the host (as `nnx.jit` does) and one small
jitted add of the metric totals; the model's donation (`nnx.jit(donate_argnames=...)`) is not
kept. JAX and Flax are imported here only when used: `import replay` imports neither.
"""

from __future__ import annotations

from typing import Any, Callable

from replay.engine.human_names import node_labels
from replay.record.errors import RecordError
from replay.record.program import Program
from replay.record.step import RecordedStep


def _nnx() -> Any:
    from flax import nnx  # optional dependency: only NNX users reach this module's functions

    return nnx


def _has_flax_base(x: Any) -> bool:
    """Whether x's class comes from Flax (checked before importing it: a plain tree never does)."""
    return any(c.__module__.startswith("flax.") for c in type(x).__mro__)


def _is_metric(x: Any) -> bool:
    return isinstance(x, _nnx().Metric)


def unwrap_nnx(fn: Callable) -> Callable:
    """The Python function of an `nnx.jit` (or `jax.jit`) step: it is traced in replay's own jit,
    where an inner jit would refuse the step's taps."""
    if not callable(fn):
        raise RecordError(f"run.nnx_step wraps a step function; got {type(fn).__name__}")
    inner = getattr(fn, "fun", None) if type(fn).__module__.startswith("flax.") else None
    inner = inner or (getattr(fn, "__wrapped__", None) if hasattr(fn, "_jit_info") else None)
    return inner if callable(inner) else fn


def as_state(tree: Any) -> Any:
    """`tree` as a recorded state: graph nodes (one, or a tuple/list of them, as the step takes
    them) become the nnx.State of those that are not metrics; anything else is returned as is."""
    nodes = tree if isinstance(tree, (tuple, list)) else (tree,)
    if not nodes or not all(_has_flax_base(n) and _nnx().graph.is_graph_node(n) for n in nodes):
        return tree
    return _nnx().split(tuple(n for n in nodes if not _is_metric(n)))[1]


def _check_metric(node: Any, where: str) -> None:
    nnx = _nnx()
    for _, sub in nnx.iter_graph(node):
        if isinstance(sub, nnx.Metric) and not isinstance(sub, (nnx.MultiMetric, nnx.metrics.Average)):
            raise RecordError(f"{where} holds a {type(sub).__name__} metric; replay records the step's value of "
                              "nnx.metrics.Average and Accuracy metrics (their totals add up across steps): return "
                              "this value from the step instead, or keep that metric outside it")


class Functional:
    """fn(*nodes, batch) as (state, batch) -> (new state, (recorded metrics, (metric totals, returned))).

    Built from the graph nodes themselves (record time) or from a function building them (replay,
    where they are only abstract: nnx.eval_shape)."""

    def __init__(self, fn: Callable, nodes: tuple | None = None, build: Callable | None = None):
        self.user_fn = fn
        self.fn = unwrap_nnx(fn)
        self.__name__ = getattr(self.fn, "__name__", "step")
        self.__qualname__ = getattr(self.fn, "__qualname__", self.__name__)
        self.__module__ = getattr(self.fn, "__module__", __name__)
        self._build, self._layout = build, None
        if nodes is not None:
            self._layout = self._describe(nodes, "run.nnx_step")

    def _describe(self, nodes: tuple, where: str) -> tuple:
        nnx = _nnx()
        metric = tuple(_is_metric(n) for n in nodes)
        for i, (n, m) in enumerate(zip(nodes, metric)):
            if m:
                _check_metric(n, f"{where}: argument {i}")
        graphdef, _ = nnx.split(tuple(n for n, m in zip(nodes, metric) if not m))
        metrics = tuple(nnx.split(n) for n, m in zip(nodes, metric) if m)
        return metric, graphdef, tuple(g for g, _ in metrics), tuple(s for _, s in metrics)

    @property
    def layout(self) -> tuple:
        if self._layout is None:
            nodes = _nnx().eval_shape(self._build)
            nodes = tuple(nodes) if isinstance(nodes, (tuple, list)) else (nodes,)
            self._layout = self._describe(nodes, "replay.Loop(nodes=...)")
        return self._layout

    @property
    def graphdef(self) -> Any:
        return self.layout[1]

    def state_of(self, nodes: tuple, same_objects: bool = True) -> Any:
        """The recorded state of the step's graph nodes (what checkpoints hold). `same_objects`: the
        nodes the layout was taken from, whose graph must not have changed since (a GraphDef holds
        the optimizer's transformation itself, so separately built nodes never compare equal)."""
        nnx = _nnx()
        metric, graphdef = self.layout[0], self.layout[1]
        if len(nodes) != len(metric) or any(_is_metric(n) != m for n, m in zip(nodes, metric)):
            raise RecordError(f"{self.__qualname__} was first called with {len(metric)} graph nodes "
                              f"({_kinds(metric)}) before the batch; call it with the same ones every step")
        now, state = nnx.split(tuple(n for n, m in zip(nodes, metric) if not m))
        if same_objects and now != graphdef:
            raise RecordError(f"{self.__qualname__}: the model's structure or mode differs from the first step's "
                              "(a model.eval() left on, a layer added): call model.train() before the train step")
        return state

    def initial_state(self) -> Any:
        nodes = self._build()
        return self.state_of(tuple(nodes) if isinstance(nodes, (tuple, list)) else (nodes,), same_objects=False)

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        import jax
        import jax.numpy as jnp

        nnx = _nnx()
        metric, graphdef, metric_defs, metric_states = self.layout
        recorded = iter(nnx.merge(graphdef, state))
        fresh = []
        for g, s in zip(metric_defs, metric_states):
            m = nnx.merge(g, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), s))
            m.reset()
            fresh.append(m)
        it = iter(fresh)
        nodes = tuple(next(it) if m else next(recorded) for m in metric)
        out = self.fn(*nodes, batch)
        new_state = nnx.split(tuple(n for n, m in zip(nodes, metric) if not m))[1]
        values: dict = {}
        for m in fresh:
            got = m.compute()
            values.update(got if isinstance(got, dict) else {getattr(m, "argname", "metric"): got})
        returned = out if isinstance(out, dict) else {} if out is None else (
            {"loss": out} if jnp.ndim(out) == 0 else {"output": out})
        clash = sorted(set(values) & set(returned))
        if clash:
            raise RecordError(f"{self.__qualname__} returns {clash[0]!r} and its metrics hold one of that name too; "
                              "rename one")
        return new_state, ({**values, **returned}, (tuple(nnx.state(m) for m in fresh), out))


class NnxProgram(Program):
    """The recorded program of a Functional step: records the step's metric values, not the
    metric totals and returned value it also hands back to the caller."""

    def _record(self, state: Any, new_state: Any, metrics: Any, taps: list, entering: Any) -> tuple:
        return super()._record(state, new_state, metrics[0], taps, entering)


def program_for(step: Callable, options: Any) -> Program:
    return NnxProgram(step, options) if isinstance(step, Functional) else Program(step, options)


class FunctionalStep(RecordedStep):
    """`run.step`'s wrapper, which says in one line when it is called as an in-place NNX step."""

    def __call__(self, *args: Any, **kw: Any) -> tuple[Any, Any]:
        if len(args) != 2 or kw:
            nodes = any(_has_flax_base(a) and _nnx().graph.is_graph_node(a) for a in args)
            raise RecordError(f"run.step: {self.__name__} was called with {len(args) + len(kw)} arguments; a run.step "
                              "step is fn(state, batch) -> (state, metrics)" + (
                                  "; for an in-place NNX step fn(model, optimizer, ..., batch) use run.nnx_step(fn)"
                                  if nodes else ""))
        return super().__call__(*args)


class NnxRecordedStep:
    """What `run.nnx_step(fn)` returns: fn's signature and return value, recorded (module doc)."""

    def __init__(self, run: Any, fn: Callable, options: Any):
        self._run, self._fn, self._options = run, fn, options
        self._functional: Functional | None = None
        self._step: RecordedStep | None = None
        self._add = None
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "step")
        self.__doc__ = getattr(fn, "__doc__", None)

    @property
    def program(self) -> Program | None:
        return None if self._step is None else self._step.program

    def __call__(self, *args: Any) -> Any:
        import jax
        import jax.numpy as jnp

        nnx = _nnx()
        nodes, batch = args[:-1], args[-1] if args else None
        if not nodes or not all(_has_flax_base(n) and nnx.graph.is_graph_node(n) for n in nodes) \
                or (_has_flax_base(batch) and nnx.graph.is_graph_node(batch)):
            raise RecordError(f"run.nnx_step: {self.__name__} is called as fn(*graph nodes, batch): NNX modules, "
                              "optimizers and metrics first, the batch last (got "
                              f"{', '.join(type(a).__name__ for a in args) or 'no arguments'})")
        if self._functional is None:
            self._functional = Functional(self._fn, nodes)
            self._step = RecordedStep(self._run, self._functional, self._options)
            self._step.program = NnxProgram(self._functional, self._options)
            # What a person calls each node of the recorded state (shown in place of its tuple index).
            self._step.program.state_names = node_labels(tuple(n for n in nodes if not _is_metric(n)))
            self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        state = self._functional.state_of(nodes)
        new_state, (_, (totals, out)) = self._step(state, batch)
        nnx.update(tuple(n for n in nodes if not _is_metric(n)), new_state)
        for node, total in zip((n for n in nodes if _is_metric(n)), totals):
            nnx.update(node, self._add(nnx.state(node), total))
        return out

    def flush(self) -> None:
        if self._step is not None:
            self._step.flush()


def _kinds(metric: tuple) -> str:
    return ", ".join("metrics" if m else "state" for m in metric)
