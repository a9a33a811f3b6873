"""The recorded step: the user's step and what its record needs, traced into one XLA program.

The user's function is traced inside the wrapper's own `jax.jit` (a `jax.jit` step is unwrapped
to its Python function, keeping its donation and shardings), so the record costs no extra
dispatch and reads only values the step has on device anyway: fingerprints of every tapped
tree, of non-scalar outputs and of the new state, plus the RNG words and the metrics as
float32, packed into one vector (replay/record/packed.py), so only one small buffer a step
reaches the host.

The state entering step k+1 is the state step k returned in a plain loop, so at the layer level
the program takes the entering state's fingerprint rows as an input and returns the new state's:
when the loop feeds back exactly the arrays it got (checked by identity, leaf by leaf), the rows
come from the previous step and the state is fingerprinted once a step, not twice; otherwise (the
first step, a restore, a loop that edits its state between steps) a small separate program
fingerprints the state before the step may donate it. Either way the record holds the
fingerprints of the state actually fed. The exported program (replay/record/export.py) is the
one-step form, which fingerprints the entering state itself.

The schema is derived while tracing: scalar outputs are metrics, float `[B]` outputs
per-example metrics, other outputs forward tensors. The same wrapping of the run's
`replay.Loop` step at replay time gives the same program (its hash is compared) and the same
schema. The step's inputs before it is traced (unwrapping its jit, the abstract values, their
placement) are replay/record/step_inputs.py's.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from replay.record.errors import RecordError
from replay.record.options import StepOptions
from traces import Schema
from replay.record.packed import pack
from replay.record.taps import collecting, tap_leaves, tap_order
from replay.record.step_inputs import (
    check_state, leaf_name, placed, replicated, spec, unwrap, without_one_device_sharding,
)

RESERVED = ("rng", "fingerprints", "rms")  # keys of the record dict (trainer.recorder.to_record)


def _is_key(x: Any) -> bool:
    import jax

    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _bits(x: Any) -> Any:
    import jax

    return jax.random.key_data(x) if _is_key(x) else x


class Program:
    """`step` wrapped so that it also returns its record: (state, metrics, record)."""

    def __init__(self, step: Callable, options: StepOptions):
        self.fn, self.jit_options = unwrap(step)
        self.options = options
        self.schema: Schema | None = None
        self.program_hash: str | None = None
        self.batch: int | None = None
        self._compiled = None
        self._rep = None  # the sharding of the chained rows
        self._entering = None  # jitted: the rows of a state entering a step, when they are not chained
        self._last_new = self._last_update = None  # the new state's leaves and rows of the last call
        self._tap_order: dict[str, list[int]] = {}  # tap name -> its leaves in execution order (taps.tap_order)
        self._everywhere = None  # several processes: the record replicated on every device, so each reads it
        self.state_names: dict | None = None  # an NNX step's node index -> its name (replay/engine/human_names.py)

    # ---------------------------------------------------------------------------- building

    def compile(self, state: Any, batch: Any) -> None:
        """Trace, lower and compile for these inputs (arrays or ShapeDtypeStructs); sets schema and hash."""
        import jax

        from replay.record.hashing import batch_size
        from replay.record.environment import program_hash

        check_state(state)
        self.batch = batch_size(batch, self.options.batch_axis)
        self.abstract = placed((jax.tree.map(spec, state), jax.tree.map(spec, batch)), self.jit_options)  # what export.py exports for
        n_state = len(jax.tree.leaves(state))
        self._tap_order = tap_order(self.fn, self.abstract) if self.options.level == "layer" else {}
        self._everywhere = replicated(self.abstract) if jax.process_count() > 1 else None
        rep = self._rep = replicated(self.abstract) if self.options.level == "layer" and n_state else None
        lowered = None
        if rep is not None:
            entering = jax.ShapeDtypeStruct((n_state, 3), np.uint32, sharding=rep)
            lowered, jitted, args = self._lower(self._chained_program, (*self.abstract, entering), rep)
            out_state = jax.tree.structure(lowered.out_info[0])
            if out_state != jax.tree.structure(self.abstract[0]):
                lowered = None  # the step returns another state structure: no update rows to chain from
            else:
                self._entering = jax.jit(_entering_rows, out_shardings=rep)
        if lowered is None:
            self._entering = None
            lowered, jitted, args = self._lower(self._program, self.abstract, None)
        # The hash is of the program as lowered for shapes and dtypes plus any layout across devices:
        # a one-device sharding (a committed array at record time, none for the eval_shape state at
        # replay) changes the text, not the program, and must not make a replay "measured only".
        hashed = jax.tree.map(without_one_device_sharding, args)
        same = all(a.sharding is b.sharding for a, b in zip(jax.tree.leaves(hashed), jax.tree.leaves(args)))
        self.program_hash = program_hash(lowered if same else jitted.trace(*hashed).lower())
        self._compiled = lowered.compile()
        self._last_new = self._last_update = None

    def _lower(self, fn: Callable, args: tuple, rep: Any) -> tuple[Any, Any, tuple]:
        import jax

        jit_options = {k: v for k, v in self.jit_options.items() if k != "out_shardings"}
        if rep is not None and "in_shardings" in jit_options:
            jit_options["in_shardings"] = (*jit_options["in_shardings"], rep)
        jitted = jax.jit(fn, **jit_options)
        stripped = jax.tree.map(without_one_device_sharding, args)
        if _default_device_only(args):
            # Every input on the default device (a one-device loop's committed arrays): the program
            # without those shardings is the same program (a replay compiles it so, from eval_shape
            # values), and it is the one the hash is of; lowering it once for both saves a trace
            # and a lowering per recording start (~0.2 s at the optax example, issue 34).
            args = stripped
        return jitted.trace(*args).lower(), jitted, args

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any, Any]:
        """(new state, the step's metrics, its record: a PackedRecord on device)."""
        import jax

        try:
            if self._entering is None:
                return self._compiled(state, batch)
            leaves = jax.tree_util.tree_leaves(state)
            last = self._last_new
            if last is None or len(last) != len(leaves) or any(a is not b for a, b in zip(leaves, last)):
                # Not the state this program returned last (the first step, a restore, or a loop that
                # changed the state between steps): fingerprint it now, before the step may donate it.
                entering = self._entering(state)
            else:
                entering = self._last_update
            new_state, metrics, record, update = self._compiled(state, batch, entering)
        except (TypeError, ValueError) as e:
            if "compiled" not in str(e) and "types" not in str(e):
                raise
            raise RecordError(f"the step's inputs differ from the first step's in shape, dtype or layout ({_brief(e)}); "
                              "a recorded step keeps the same input shapes every step") from None
        # Held, not copied: the leaves the caller holds anyway, so the next call can tell whether it
        # is fed exactly this state (then the state entering it is this step's update, fingerprinted).
        self._last_new, self._last_update = jax.tree_util.tree_leaves(new_state), update
        return new_state, metrics, record

    def _program(self, state: Any, batch: Any) -> tuple[Any, Any, Any]:
        """The step and its whole record, the state entering it fingerprinted in the same program
        (what replay/record/export.py exports: a replay of one step at a time)."""
        new_state, metrics, record, _ = self._step_and_record(state, batch, None)
        return new_state, metrics, record

    def _chained_program(self, state: Any, batch: Any, entering: Any) -> tuple[Any, Any, Any, Any]:
        """The recorded program at the layer level: the state entering the step comes fingerprinted
        (`entering`, uint32[S, 3]: lanes and RMS bits per state leaf), from the previous step's
        update when the loop feeds the state it got back, which is every step of a plain loop, so
        the whole state is fingerprinted once per step, not twice. Also returns the new state's
        rows for the next step."""
        return self._step_and_record(state, batch, entering)

    def _step_and_record(self, state: Any, batch: Any, entering: Any) -> tuple[Any, Any, Any, Any]:
        import jax


        # The step gets its own containers: an in-place step (nnx.merge without copy shares the
        # State's Variables) must not rewrite what is fingerprinted as the state entering it.
        leaves, treedef = jax.tree_util.tree_flatten(state)
        with collecting() as taps:
            out = self.fn(jax.tree_util.tree_unflatten(treedef, leaves), batch)
        _check_taps(taps)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise RecordError(f"the step returned {type(out).__name__}; a recorded step returns (state, metrics)")
        new_state, metrics = out
        out_sh = self.jit_options.get("out_shardings")
        if out_sh is not None:
            sh = out_sh if isinstance(out_sh, (tuple, list)) else (out_sh, out_sh)
            new_state = jax.lax.with_sharding_constraint(new_state, sh[0])
            metrics = jax.lax.with_sharding_constraint(metrics, sh[1])
        try:
            record, self.schema, update = self._record(state, new_state, metrics, taps, entering)
            if entering is not None and update is not None:
                update = jax.lax.with_sharding_constraint(update, self._rep)
        except jax.errors.UnexpectedTracerError:
            raise RecordError("a replay.tap inside a function JAX transforms on its own (the loss function of "
                              "jax.grad, scan, vmap, an inner jit) cannot be recorded; return that value from it "
                              "(has_aux=True) and tap it at the step's top level") from None
        packed = pack(record)
        if self._everywhere is not None:  # several devices: every process reads the record whole
            packed = jax.lax.with_sharding_constraint(packed, self._everywhere)
        return new_state, metrics, packed, update

    # ---------------------------------------------------------------------------- the record

    def _record(self, state: Any, new_state: Any, metrics: Any, taps: list,
                entering: Any) -> tuple[dict, Schema, Any]:
        import jax
        import jax.numpy as jnp

        o, B = self.options, self.batch
        scalars, examples, outputs = [], [], []
        flat = [(leaf_name(path, "/") or "metric", x) for path, x in jax.tree_util.tree_flatten_with_path(metrics)[0]]
        if o.metrics is not None:  # run.step(metrics=...): only these outputs (and the loss) are recorded
            unknown = [m for m in o.metrics if m not in {n for n, _ in flat}]
            if unknown:
                raise RecordError(f"run.step(metrics=...): the step returns no output {unknown[0]!r} (its outputs: "
                                  f"{', '.join(n for n, _ in flat[:12]) or 'none'}); name outputs it returns")
            flat = [(n, x) for n, x in flat if n in o.metrics or n == o.loss]
        for name, x in flat:
            x = jnp.asarray(x)
            if x.ndim == 0:
                scalars.append((name, x))
            elif x.shape == (B,) and jnp.issubdtype(x.dtype, jnp.floating):
                examples.append((name.removeprefix("example_") or name, x))  # "example_loss" records as "loss"
            else:
                outputs.append((f"output/{name}", _bits(x)))
        names = [n for n, _ in scalars]
        metric_list = list(scalars)
        if o.loss is not None:
            if o.loss not in names:
                raise RecordError(f"the step returns no scalar metric {o.loss!r} (its scalar metrics: "
                                  f"{', '.join(names) or 'none'}); return your loss as {o.loss!r}, name it with "
                                  "run.step(loss=NAME), or pass loss=None for a step without one (replay spike "
                                  "needs a loss)")
            i = names.index(o.loss)
            metric_list = [("loss", scalars[i][1])] + [s for j, s in enumerate(scalars) if j != i]
        trace_names = [n for n, _ in metric_list]
        reserved = RESERVED + (("sketches", "norms") if o.sketch_width else ())
        clash = ([n for n in trace_names if n in reserved or n.startswith("example_")]
                 + [n for n in trace_names[1:] if n == "loss"])
        if clash:
            raise RecordError(f"metric name {clash[0]!r} is reserved in a trace record ({', '.join(reserved)}, "
                              "example_*, and loss for the loss); rename that metric")
        kinds = [("loss" if n == "loss" else o.metric_kinds.get(n, "update")) for n in trace_names]
        record = {n: x.astype(jnp.float32) for n, x in metric_list}
        for name, x in examples:
            record[f"example_{name}"] = x.astype(jnp.float32)
        record["rng"] = self._rng_words(state, taps)
        tensors: list[tuple[str, str, Any]] = []
        if o.level == "layer":
            tensors += [(_join("state", p), "state", _bits(x)) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]
            for kind in ("forward", "backward"):
                for name, k, tree in taps:
                    if k == kind:
                        tensors += [(n, kind, _bits(x)) for n, x in tap_leaves(tree, name, self._tap_order.get(name))]
                if kind == "forward":
                    tensors += [(n, "forward", x) for n, x in outputs]
            tensors += [(_join("update", p), "update", _bits(x))
                        for p, x in jax.tree_util.tree_flatten_with_path(new_state)[0]]
            tnames = [n for n, _, _ in tensors]
            dup = next((n for n in tnames if tnames.count(n) > 1), None)
            if dup:
                raise RecordError(f"two recorded tensors are both named {dup!r}; rename the tap")
            n_state = sum(1 for _, k, _ in tensors if k == "state")
            if entering is not None:  # the state entering the step arrives fingerprinted
                lanes, rms = _measure([x for _, k, x in tensors if k != "state"])
                state_lanes, state_rms = entering[:, :2], jax.lax.bitcast_convert_type(entering[:, 2], jnp.float32)
                record["fingerprints"] = jnp.concatenate([state_lanes, lanes])
                record["rms"] = jnp.concatenate([state_rms, rms])
            else:
                record["fingerprints"], record["rms"] = _measure([x for _, _, x in tensors])
            # The new state's rows, for the next step's `entering` (the last rows: update comes last).
            update = _rows(record["fingerprints"][-n_state:], record["rms"][-n_state:]) if n_state else None
            if o.sketch_width:
                # The state entering the step is sketched here, not chained like its fingerprints: read
                # before the step's update in the same program (XLA keeps a donated input until its
                # last reader), so the record holds the sketches of the state actually fed.
                # The norms are the fingerprint pass's RMS * sqrt(elements), as the trainer's
                # (trainer/sketches.py): no second pass over the tensors for their sums of squares.
                from replay.record.fingerprint import norms_from_rms, sketch_rows

                xs = [x for _, _, x in tensors]
                record["sketches"] = sketch_rows(xs, o.sketch_width)
                record["norms"] = norms_from_rms(record["rms"], [np.prod(np.shape(x)) for x in xs])
        schema = Schema(examples_per_step=B, rng_words=int(record["rng"].shape[0]),
                        metrics=tuple(zip(trace_names, kinds)), tensors=tuple((n, k) for n, k, _ in tensors),
                        example_metrics=tuple(n for n, _ in examples),
                        sketch_width=o.sketch_width if o.level == "layer" else 0)
        return record, schema, (update if o.level == "layer" else None)

    def _rng_words(self, state: Any, taps: list) -> Any:
        """uint32 words of every typed key in the state, the uint32 leaves run.step(rng=...) names,
        and the trees tapped as rng, in that order."""
        import jax
        import jax.numpy as jnp

        flat = {leaf_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
        words = [jax.random.key_data(x).reshape(-1) for x in flat.values() if _is_key(x)]
        for name in self.options.rng:
            if name not in flat:
                raise RecordError(f"run.step(rng=[{name!r}]): the state has no leaf {name!r} (its leaves: "
                                  f"{', '.join(list(flat)[:8])}{', ...' if len(flat) > 8 else ''})")
            if flat[name].dtype != jnp.uint32:
                raise RecordError(f"run.step(rng=[{name!r}]): that leaf is {flat[name].dtype}, not uint32 key words")
            words.append(flat[name].reshape(-1))
        for name, kind, tree in taps:
            if kind != "rng":
                continue
            for x in jax.tree.leaves(tree):
                bits = _bits(x)
                if bits.dtype != jnp.uint32:
                    raise RecordError(f"replay.tap({name!r}) as rng: {x.dtype} is neither a typed key nor uint32 words")
                words.append(bits.reshape(-1))
        return jnp.concatenate(words) if words else jnp.zeros((0,), jnp.uint32)


def _measure(xs: list) -> tuple[Any, Any]:
    """uint32[T, 2] fingerprint lanes and float32[T] RMS of tensors, in one fused pass each."""
    import jax.numpy as jnp

    from replay.record.fingerprint import fingerprints_and_sums_of_squares

    lanes, ss = fingerprints_and_sums_of_squares([jnp.asarray(x) for x in xs])
    sizes = jnp.asarray([max(1, int(np.prod(np.shape(x)))) for x in xs], jnp.float32)
    return lanes, jnp.sqrt(ss / sizes)


def _rows(lanes: Any, rms: Any) -> Any:
    """uint32[T, 3]: lanes and the RMS's bits side by side (what `entering` carries)."""
    import jax
    import jax.numpy as jnp

    return jnp.concatenate([lanes, jax.lax.bitcast_convert_type(rms, jnp.uint32)[:, None]], axis=1)


def _entering_rows(state: Any) -> Any:
    """The rows of the state entering a step, measured on its own (the first step, a restore)."""
    import jax

    xs = [_bits(x) for x in jax.tree_util.tree_leaves(state)]
    return _rows(*_measure(xs))


def _default_device_only(args: tuple) -> bool:
    """Whether every input is placed on the default device or not placed at all."""
    import jax

    if jax.config.jax_default_device is not None:
        return False
    default = jax.devices()[0]
    for x in jax.tree.leaves(args):
        sharding = getattr(x, "sharding", None)
        if sharding is not None and not (isinstance(sharding, jax.sharding.SingleDeviceSharding)
                                         and next(iter(sharding.device_set)) == default):
            return False
    return True


def _check_taps(taps: list) -> None:
    """A tapped value from inside a separately transformed function (grad's loss function, scan,
    vmap) is a tracer of that inner transformation, not of the step's trace: refuse it."""
    import jax
    from jax._src import core  # no public way to ask which trace a tracer belongs to

    current = getattr(getattr(core, "trace_ctx", None), "trace", None)
    for name, _, tree in taps:
        for x in jax.tree.leaves(tree):
            if isinstance(x, core.Tracer) and current is not None and x._trace is not current:
                raise RecordError(f"replay.tap({name!r}) was called inside a function JAX transforms on its own "
                                  "(the loss function of jax.grad, scan, vmap, an inner jit), so its value cannot "
                                  "be recorded; return that value from it (has_aux=True) and tap it at the step's "
                                  "top level")


def _join(prefix: str, path: tuple) -> str:
    p = leaf_name(path)
    return f"{prefix}/{p}" if p else prefix


def _brief(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]
