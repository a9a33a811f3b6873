"""The replay side, declared once: `@replay.entrypoint def make(config) -> replay.Loop`.

The manifest names the factory ("module:function"); `replay run` imports it under the code
policy of replay/engine/code.py, calls it with the recorded config, wraps `Loop.step` exactly as
`run.step` wrapped it while training, restores checkpoints onto the Loop's state and feeds
`batch_at(k)`, or, for a loop whose data is an iterator checkpointed with the state, the
iterator from `data()` restored to the state saved with the checkpoint it starts from
(replay/record/data_iterator.py). Using the same factory to build the training loop (as
examples/optax_loop.py does) keeps training and replay on one definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from replay.record.errors import RecordError

MARK = "__replay_entrypoint__"


@dataclass(frozen=True)
class Loop:
    """What replay needs to re-run a recorded loop.

    step: the (jitted) train step, (state, batch) -> (state, metrics), as `run.step` wrapped it.
    Or, for a Flax NNX step written in place, as `run.nnx_step` wrapped it:
      nnx_step: fn(*graph nodes, batch), e.g. the `@nnx.jit` train_step(model, optimizer, metrics, batch);
      nodes: () -> the graph nodes it takes, fresh, in its order (e.g. create(cfg) -> (model,
        optimizer, metrics)). They stand for step= and init=: the Loop's `step` and `init` become
        their functional form (replay/record/nnx_step.py), the state the nodes' Variables but the metrics'.
    The batches, one of:
      batch_at: step -> the batch of that step (a pure function of the config and the step);
      data: () -> a fresh data iterator with grain's get_state()/set_state(state), whose state
        the run saved with every checkpoint (`run.save(k, state, data=it)`). Replay restores
        the state saved with the checkpoint it starts from and takes next(it) for each step.
    init: () -> the initial state; or abstract_state: its shapes and dtypes (a tree of
      jax.ShapeDtypeStruct). Checkpoints are restored onto it, so give one of the two.
    For `replay compare A B --eval` (optional; without them it refuses in one line naming the field):
      evaluate: (state, batch) -> float32 [n], each of the batch's n examples' loss under `state`
        as the loop defines it, deterministic (no dropout), without changing or donating `state`;
      eval_batches: () -> a fresh finite iterable of held-out batches (examples training never
        feeds), the same on every call and for both runs compared (run A's are used for both).
    For a loop that checkpoints through its own manager (another layout, another numbering) rather
    than `run.save` (optional):
      checkpoints: an object with steps() -> the steps k whose state ENTERING step k it can give
        (replay's numbering: MaxText's checkpoint s, the state after step s, is k = s + 1) and
        restore(k) -> that state, a tree like the Loop's state (replay/record/loop_checkpoints.py,
        `LoopCheckpoints`). Replay uses its own checkpoint k first; a state the loop gives is
        verified against the trace's recorded fingerprints of the state entering step k (one line,
        exit 2, when it differs), so the run needs no second copy of the state. With batch_at only:
        replay restores a data iterator from its own checkpoints.
    """

    step: Callable[[Any, Any], tuple[Any, Any]] | None = None
    batch_at: Callable[[int], Any] | None = None
    init: Callable[[], Any] | None = None
    abstract_state: Any = None
    data: Callable[[], Any] | None = None
    evaluate: Callable[[Any, Any], Any] | None = None
    eval_batches: Callable[[], Any] | None = None
    nnx_step: Callable | None = None
    nodes: Callable[[], Any] | None = None
    checkpoints: Any = None

    def __post_init__(self):
        if self.nnx_step is not None or self.nodes is not None:
            self._nnx()
        if not callable(self.step):
            raise RecordError("replay.Loop(step=...): the train step must be a function "
                              "(state, batch) -> (state, metrics)")
        if (self.batch_at is None) == (self.data is None):
            raise RecordError("replay.Loop: give exactly one of batch_at= (a function step -> batch) and data= (a "
                              "function returning a fresh data iterator whose state run.save(..., data=) checkpoints)")
        if self.batch_at is not None and not callable(self.batch_at):
            raise RecordError("replay.Loop(batch_at=...): must be a function step -> batch")
        if self.data is not None and not callable(self.data):
            raise RecordError(f"replay.Loop(data=...): must be a function () -> a fresh data iterator, not the "
                              f"{type(self.data).__name__} itself (e.g. data=lambda: iter(dataset))")
        if self.init is None and self.abstract_state is None:
            raise RecordError("replay.Loop: give init= (a function returning the initial state) or abstract_state= "
                              "(its jax.ShapeDtypeStructs): checkpoints are restored onto it")
        if self.init is not None and not callable(self.init):
            raise RecordError("replay.Loop(init=...): must be a function () -> state")
        missing = [m for m in ("steps", "restore") if not callable(getattr(self.checkpoints, m, None))]
        if self.checkpoints is not None and missing:
            raise RecordError(f"replay.Loop(checkpoints=...): a {type(self.checkpoints).__name__} has no "
                              f"{' or '.join(missing)} method; give an object with steps() -> [k] and restore(k) -> "
                              "the state entering step k")
        if self.checkpoints is not None and self.data is not None:
            raise RecordError("replay.Loop(checkpoints=..., data=...): replay restores a data iterator only from its "
                              "own checkpoints (run.save(k, state, data=it)); give batch_at with the loop's checkpoints")
        if self.evaluate is not None and not callable(self.evaluate):
            raise RecordError("replay.Loop(evaluate=...): must be a function (state, batch) -> float32 [n], each "
                              "example's loss")
        if self.eval_batches is not None and not callable(self.eval_batches):
            raise RecordError(f"replay.Loop(eval_batches=...): must be a function () -> a fresh iterable of held-out "
                              f"batches, not the {type(self.eval_batches).__name__} itself (e.g. eval_batches=lambda: "
                              "[batch_at(k) for k in held_out_steps])")

    def _nnx(self) -> None:
        from replay.record.nnx_step import Functional

        if isinstance(self.step, Functional) and self.step.user_fn is self.nnx_step:
            return  # dataclasses.replace of such a Loop: already in functional form
        if self.step is not None or self.init is not None or self.abstract_state is not None:
            raise RecordError("replay.Loop(nnx_step=..., nodes=...) stands for step= and init=/abstract_state=: give "
                              "one form or the other")
        if not callable(self.nnx_step) or not callable(self.nodes):
            raise RecordError("replay.Loop(nnx_step=fn, nodes=build): fn(*graph nodes, batch) is the in-place NNX "
                              "step, build() returns the graph nodes it takes, fresh, in its order; give both")
        functional = Functional(self.nnx_step, build=self.nodes)
        object.__setattr__(self, "step", functional)
        object.__setattr__(self, "init", functional.initial_state)

    def state_shapes(self) -> Any:
        """The abstract state (jax.ShapeDtypeStruct leaves, on this machine's first device when the
        Loop does not say), without computing the state."""
        import jax

        tree = self.abstract_state if self.abstract_state is not None else jax.eval_shape(self.init)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

        def leaf(s: Any) -> Any:
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=getattr(s, "sharding", None) or device)

        return jax.tree.map(leaf, tree)


def entrypoint(fn: Callable[[dict], Loop]) -> Callable[[dict], Loop]:
    """Marks `fn(config) -> replay.Loop` as a loop factory replay may call; returns `fn` unchanged."""
    if not callable(fn):
        raise RecordError("@replay.entrypoint decorates a function config -> replay.Loop")
    setattr(fn, MARK, True)
    return fn
