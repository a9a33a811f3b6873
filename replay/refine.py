"""Replay-based refinement for `bisect`: look inside the divergent step, and find it when the
traces are too sparse to.

Two things live here, both built on replaying the two runs on this machine from their own
checkpoints (read-only; nothing in either run changes):

* `search_first_divergence`: binary search by replay (bisect step 5, sparse traces). The runs'
  states (parameters and optimizer state, by device fingerprints) are compared at common
  checkpoints first (restores, no steps run), then both runs are replayed to the midpoint of
  the last equal and the first differing state, reusing the lower bound's states so no probe
  starts from scratch: O(log N) probes. The divergent step is the first step whose *output*
  state differs: the step k with equal states entering it and differing states after it.
* `refine_step` (bisect step 4): at the divergent step, recompute with full instrumentation
  what that step's train_step computed for each run (its own params, batch, dropout key and,
  for a `layer-bf16` fault, its faulty program) and compare element by element: inside a
  forward layer the block's intermediates (`model.block_capture_names`) in execution order;
  for state, gradient and update fields the tensors leaf by leaf in the schema's causal order.
  It names the first intermediate (or leaf) that differs with its max abs, relative and ULP
  distance and the share of elements that differ. Without a trace field to refine (a trace
  that records no tensors at that step, or none at all) it walks the whole causal chain --
  data, rng, state, forward by layer, loss, backward, update -- and refines the first field
  that differs.

Replays are counted as *probes*: one probe replays both runs to one step and compares them.
`Replayer.replayed_steps` counts the single steps actually re-run.

The recomputation is a separate jitted program from the training step (full batch; a
mesh-invariant run's microbatched gradients are recomputed the plain way), so its bits need
not equal the step's own -- but both runs go through the same program, so what differs
between them is what their inputs and configs make differ.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from traces import Run, diff_records

TENSOR_KINDS = ("state", "forward", "backward", "update")


class ReplayUnavailable(Exception):
    """A run that cannot be replayed here (missing checkpoint, data, code): bisect notes it."""


# ------------------------------------------------------------------------ element-wise distance

def _is_float(dtype: np.dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _ordered(bits: np.ndarray, width: int) -> np.ndarray:
    """Sign-magnitude float bits (as signed ints) mapped onto a monotonic integer line."""
    i = bits.astype(np.int64)
    return np.where(i >= 0, i, -(2 ** (width - 1)) - i) if width < 64 else np.where(i >= 0, i, np.int64(-(2**63)) - i)


def compare_tensors(a: Any, b: Any) -> dict:
    """Element-wise comparison of two tensors: equal (bits and dtype), the share of elements
    whose bits differ, and max abs, relative and ULP distance (where the max ULP is, with both
    values). Floats of different dtypes (bfloat16 vs float32) compare as float32 values and
    never count as equal; ULPs are counted in the wider of the two dtypes."""
    a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
    out: dict = {"shape": list(a.shape), "dtype_a": str(a.dtype), "dtype_b": str(b.dtype), "elements": int(a.size)}
    if a.shape != b.shape:
        out.update(equal=False, shape_b=list(b.shape), differing=None, share_differing=1.0,
                   max_abs=None, max_rel=None, max_ulp=None, note="shapes differ")
        return out
    if _is_float(a.dtype) or _is_float(b.dtype):
        wide = np.float64 if np.dtype(np.float64) in (a.dtype, b.dtype) else np.float32
        bits_t, width = (np.int64, 64) if wide is np.float64 else (np.int32, 32)
        fa, fb = a.astype(wide), b.astype(wide)
        differ = fa.view(bits_t) != fb.view(bits_t)
        nan = np.isnan(fa) | np.isnan(fb)
        ok = ~nan
        absd = np.where(ok, np.abs(fa.astype(np.float64) - fb.astype(np.float64)), 0.0)
        scale = np.maximum(np.abs(fa.astype(np.float64)), np.abs(fb.astype(np.float64)))
        rel = np.where(ok & (scale > 0), absd / np.where(scale > 0, scale, 1.0), 0.0)
        oa, ob = _ordered(fa.view(bits_t), width), _ordered(fb.view(bits_t), width)
        ulp = np.where(ok, np.abs(oa.astype(np.float64) - ob.astype(np.float64)) if width == 64 else np.abs(oa - ob), 0)
        if nan.any():
            out["nan_a"], out["nan_b"] = int(np.isnan(fa).sum()), int(np.isnan(fb).sum())
    elif a.dtype.kind in "iub" and b.dtype.kind in "iub":
        ia, ib = a.astype(np.int64), b.astype(np.int64)
        differ = ia != ib
        absd = np.abs(ia - ib).astype(np.float64)
        scale = np.maximum(np.abs(ia), np.abs(ib)).astype(np.float64)
        rel = np.where(scale > 0, absd / np.where(scale > 0, scale, 1.0), 0.0)
        ulp = absd
    else:  # anything else: bytes only
        differ = np.asarray(a.tobytes() != b.tobytes()).reshape((1,) * a.ndim) if a.size else np.zeros(a.shape, bool)
        absd = rel = ulp = np.zeros(differ.shape)
    n_differ = int(np.count_nonzero(differ))
    out.update(equal=n_differ == 0 and a.dtype == b.dtype, differing=n_differ,
               share_differing=n_differ / a.size if a.size else 0.0,
               max_abs=float(absd.max()) if absd.size else 0.0, max_rel=float(rel.max()) if rel.size else 0.0,
               max_ulp=int(ulp.max()) if ulp.size else 0)
    if n_differ and a.size:
        where = np.unravel_index(int(np.argmax(np.where(differ, ulp, -1))), a.shape)
        out.update(at=[int(i) for i in where], a_value=_scalar(a[where]), b_value=_scalar(b[where]))
    return out


def _scalar(x: Any) -> float | int:
    x = np.asarray(x)
    return int(x) if x.dtype.kind in "iub" else float(x.astype(np.float64))


def _brief(name: str, d: dict) -> dict:
    """One row of a `compared` list."""
    row = {"name": name, "equal": bool(d["equal"])}
    if not d["equal"]:
        row.update(share_differing=d["share_differing"], max_ulp=d["max_ulp"], max_abs=d["max_abs"])
        if d["dtype_a"] != d["dtype_b"]:
            row.update(dtype_a=d["dtype_a"], dtype_b=d["dtype_b"])
    return row


# ------------------------------------------------------------------------ opening runs for replay

_CACHE: "OrderedDict[tuple, Any]" = OrderedDict()
_CACHE_SIZE = 6


def open_replayable(run: Run) -> Any:
    """The run's replayable (trainer.replayable.load), reused while the run is unchanged: a
    process that bisects several pairs against one run compiles its step once."""
    manifest = json.dumps(run.manifest, sort_keys=True, default=str).encode()
    key = (str(Path(run.path).resolve()), hashlib.sha256(manifest).hexdigest())
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    from trainer.replayable import load

    try:
        rep = load(run)
    except Exception as e:  # noqa: BLE001 - any reason a run cannot be replayed here becomes a note
        raise ReplayUnavailable(f"{run.path} cannot be replayed here ({type(e).__name__}: {_one_line(e)})") from e
    _CACHE[key] = rep
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return rep


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _copy(tree: Any) -> Any:
    """A copy with fresh buffers: the compiled step donates its input state."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


class Replayer:
    """One run, replayed on this machine from its own checkpoints."""

    def __init__(self, label: str, run: Run):
        self.label = label
        self.run = run
        self._rep = None
        self._ckpts: list[int] | None = None
        self.replayed_steps = 0  # single steps re-run
        self.restores = 0

    @property
    def rep(self) -> Any:
        if self._rep is None:
            self._rep = open_replayable(self.run)
        return self._rep

    @property
    def built(self) -> Any:
        """trainer.loop.Built for runs of trainer/, None for other training loops."""
        return getattr(self.rep, "built", None)

    def checkpoints(self) -> list[int]:
        if self._ckpts is None:
            try:
                steps = list(self.rep.checkpoint_steps())
            except ReplayUnavailable:
                raise
            except Exception as e:  # noqa: BLE001
                raise ReplayUnavailable(f"{self.run.path}: its checkpoints cannot be read ({_one_line(e)})") from e
            self._ckpts = sorted(steps) + ([0] if self.built is not None and 0 not in steps else [])
            self._ckpts.sort()
        return self._ckpts

    def restore(self, k: int) -> Any:
        """The state entering step k from checkpoint k (or, at 0, the run's initial state)."""
        self.restores += 1
        try:
            if k in self.rep.checkpoint_steps():
                return self.rep.restore(k)
            if k == 0 and self.built is not None:
                from trainer import mesh as meshlib

                return meshlib.init_sharded_state(self.built.cfg, self.built.mesh)
        except Exception as e:  # noqa: BLE001
            raise ReplayUnavailable(f"{self.run.path}: checkpoint {k} cannot be restored ({_one_line(e)})") from e
        raise ReplayUnavailable(f"{self.run.path} has no checkpoint {k}")

    def advance(self, state: Any, start: int, stop: int, keep_input: bool = True) -> Any:
        """The state entering step `stop`, replayed from `state` entering `start`."""
        if stop > start and keep_input:
            state = _copy(state)
        for step in range(start, stop):
            state, _, _ = self.rep.step(state, step)
            self.replayed_steps += 1
        return state

    def state_at(self, k: int) -> tuple[int, Any]:
        """(checkpoint used, state entering step k): the newest checkpoint at or before k, replayed."""
        before = [c for c in self.checkpoints() if c <= k]
        if not before:
            have = ", ".join(map(str, self.checkpoints())) or "none"
            raise ReplayUnavailable(f"{self.run.path} has no checkpoint at or before step {k} (checkpoints: {have})")
        start = max(before)
        return start, self.advance(self.restore(start), start, k, keep_input=False)


# ------------------------------------------------------------------------ comparing states

class _ParamsAndOpt(NamedTuple):
    params: Any
    opt_state: Any


def _comparable(state: Any) -> Any:
    """What "the state" means for the search: parameters, then optimizer state, when the state
    has them (trainer/ and optax-style loops), else the whole state."""
    if hasattr(state, "params") and hasattr(state, "opt_state"):
        return _ParamsAndOpt(state.params, state.opt_state)
    return state


@jax.jit
def _device_fingerprints(tree: Any) -> Any:
    from trainer.fingerprint import fingerprint_lanes

    return jax.tree.map(fingerprint_lanes, tree)


def state_fingerprints(state: Any) -> list[tuple[str, int]]:
    """(leaf path, 64-bit fingerprint) of every leaf of the state's parameters and optimizer
    state, in tree order; computed on the device, so only 8 bytes per leaf come back."""
    tree = _comparable(state)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in leaves]
    try:
        lanes = jax.device_get(_device_fingerprints(tree))
        values = [(int(l[0]) << 32) | int(l[1]) for l in jax.tree.leaves(lanes)]
    except TypeError:  # a dtype the device fingerprint does not take (8-byte without x64): host
        from traces.fingerprint import fingerprint

        values = [fingerprint(np.asarray(jax.device_get(x))) for _, x in leaves]
    return list(zip(paths, values))


def first_state_difference(sa: Any, sb: Any) -> str | None:
    """The first leaf (tree order) whose fingerprint differs, else None."""
    fa, fb = state_fingerprints(sa), state_fingerprints(sb)
    if [p for p, _ in fa] != [p for p, _ in fb]:
        raise ReplayUnavailable("the runs' states have different structures (different models or optimizers); "
                                "there is no step at which they were the same")
    return next((p for (p, x), (_, y) in zip(fa, fb) if x != y), None)


# ------------------------------------------------------------------------ binary search by replay

@dataclass
class Search:
    """Where the runs' states first part, found from checkpoints and replays."""

    first_step: int | None  # the first step whose output state differs; None: states equal throughout
    states: tuple[Any, Any] | None = None  # both runs' states entering first_step
    probes: list[dict] = field(default_factory=list)  # [{step, how: checkpoint|replay, equal, leaf}]
    replays: int = 0  # replay probes (both runs replayed to one step and compared)
    checkpoint_probes: int = 0  # checkpoint comparisons (restores, no step run)
    bounds: tuple[int, int] | None = None  # (last equal, first differing) checkpoint before replaying
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"first_step": self.first_step, "probes": self.probes, "replays": self.replays,
                "checkpoint_probes": self.checkpoint_probes, "checkpoint_bounds": list(self.bounds) if self.bounds else None,
                "notes": self.notes}


def search_first_divergence(ra: Replayer, rb: Replayer, upper: int | None = None, end: int | None = None) -> Search:
    """Binary search for the first step whose output state differs between the two runs.

    upper: a step whose input states are already known to differ (e.g. replayed there); None
      to start from the newest common checkpoint (at or before `end`, if given), which is
      compared first: equal there means the states never part (Search.first_step None).
    Assumes that once the states differ they stay different (a run does not un-diverge).
    """
    search = Search(None)
    common = sorted(set(ra.checkpoints()) & set(rb.checkpoints()))
    if end is not None:
        common = [c for c in common if c <= end]
    if upper is not None:
        common = [c for c in common if c < upper]

    def checkpoint_probe(k: int) -> tuple[bool, tuple[Any, Any]]:
        sa, sb = ra.restore(k), rb.restore(k)
        leaf = first_state_difference(sa, sb)
        search.checkpoint_probes += 1
        search.probes.append({"step": k, "how": "checkpoint", "equal": leaf is None, "leaf": leaf})
        return leaf is None, (sa, sb)

    held: dict[int, tuple[Any, Any]] = {}
    if upper is None:
        if not common:
            raise ReplayUnavailable("the runs have no checkpoint in common to compare their states at")
        upper = common.pop()
        equal, states = checkpoint_probe(upper)
        if equal:
            search.notes.append(f"states equal at step {upper}, the newest checkpoint both runs have")
            return search
    # Last equal checkpoint below `upper`, by binary search over the common checkpoints.
    lo_i, hi_i = -1, len(common)
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        equal, states = checkpoint_probe(common[mid])
        if equal:
            lo_i = mid
            held = {common[mid]: states}
        else:
            hi_i = mid
    hi = common[hi_i] if hi_i < len(common) else upper
    if lo_i < 0:
        if hi == 0 or (common and common[0] == 0):
            # The states differ before any step ran: step 0 is the first whose output differs.
            search.first_step = 0
            search.states = (ra.restore(0), rb.restore(0))
            search.notes.append("the states differ before step 0 (initial state)")
            return search
        search.notes.append(f"the states already differ at step {hi}, the earliest state both runs can restore")
        search.first_step = None
        search.bounds = (None, hi)
        return search
    lo = common[lo_i]
    search.bounds = (lo, hi)
    base_a, base_b = held[lo]
    # Replay both runs from the lower bound to the midpoint; keep the bound's states.
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ma, mb = ra.advance(base_a, lo, mid), rb.advance(base_b, lo, mid)
        leaf = first_state_difference(ma, mb)
        search.replays += 1
        search.probes.append({"step": mid, "how": "replay", "equal": leaf is None, "leaf": leaf})
        if leaf is None:
            lo, base_a, base_b = mid, ma, mb
        else:
            hi = mid
    search.first_step = lo
    search.states = (base_a, base_b)
    return search


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


def _get(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _walk(items: list[tuple[str, Callable[[], Any], Callable[[], Any]]]) -> tuple[str | None, dict | None, list[dict]]:
    """Compares (name, a, b) in order; (first differing name, its comparison, compared rows).
    Keeps going after the first difference (the rows show what else differs)."""
    first, detail, rows = None, None, []
    for name, fa, fb in items:
        d = compare_tensors(fa(), fb())
        rows.append(_brief(name, d))
        if first is None and not d["equal"]:
            first, detail = name, d
    return first, detail, rows


def _opt_leaves(opt_state: Any) -> list[tuple[str, Any]]:
    return [("opt_state." + jax.tree_util.keystr(p, simple=True, separator="."), x)
            for p, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]]


def _tensor_groups(a: _Side, b: _Side) -> list[tuple[str, str, Callable[[], list]]]:
    """(kind, schema field, lazily built [(name, a(), b())]) in causal order."""
    from trainer import model

    names = list(model.param_names(a.cfg.model))
    layer_names = list(model.layer_names(a.cfg.model))

    def leaves(get_a: Callable, get_b: Callable, order: list[str], pick: Callable = _get) -> Callable[[], list]:
        return lambda: [(n, (lambda n=n: pick(get_a(), n)), (lambda n=n: pick(get_b(), n))) for n in order]

    def opt() -> list:
        la, lb = _opt_leaves(a.inp.state.opt_state), _opt_leaves(b.inp.state.opt_state)
        if [n for n, _ in la] != [n for n, _ in lb]:
            raise ReplayUnavailable("the runs' optimizer states have different structures")
        return [(n, (lambda x=x: x), (lambda y=y: y)) for (n, x), (_, y) in zip(la, lb)]

    def loss() -> list:
        return [(n, (lambda n=n: a.loss_and_grads()[0][n]), (lambda n=n: b.loss_and_grads()[0][n]))
                for n in ("loss", "z_loss", "example_loss")]

    return [
        ("state", "state/params", leaves(a.params, b.params, names)),
        ("state", "state/opt_state", opt),
        ("forward", "layers", leaves(a.layers, b.layers, layer_names, pick=lambda d, n: d[n])),
        ("loss", "loss", loss),
        ("backward", "grad", leaves(lambda: a.loss_and_grads()[1], lambda: b.loss_and_grads()[1],
                                    list(reversed(names)))),
        ("update", "param", leaves(lambda: a.after()[0].params, lambda: b.after()[0].params, names)),
    ]


def _target_group(kind: str, name: str) -> str:
    if kind == "forward":
        return "layers"
    if name.startswith("grad/"):
        return "grad"
    if name.startswith("param/"):
        return "param"
    return name  # state/params, state/opt_state


def _layer_of(group: str, item: str) -> str:
    """The schema field an item of a group belongs to."""
    if group == "grad":
        return f"grad/{item}"
    if group == "param":
        return f"param/{item}"
    if group == "layers":
        return item
    return group


def refine_step(ra: Replayer, rb: Replayer, step: int, states: tuple[Any, Any],
                focus: tuple[str, str] | None = None) -> dict:
    """Recompute step `step` of both runs from their states entering it (before faults) and
    name the first intermediate that differs.

    focus: (kind, schema field) the trace named (e.g. ("forward", "block_01.attn")); None to
      walk the causal chain and refine the first field that differs.
    Returns a JSON-able dict (bisect's report.refinement): cause and layer (the schema field),
    first_intermediate (inside a block: a block_capture_names entry; for state, gradient and
    update fields: the parameter or optimizer-state leaf), distances (max_abs, max_rel,
    max_ulp), share_differing, compared ([{name, equal, ...}] in causal/execution order),
    reproduces_trace ({A, B}: whether replaying the step gave the recorded record).
    """
    from trainer import model

    if ra.built is None or rb.built is None:
        raise ReplayUnavailable("layer refinement needs runs of trainer/ (another loop's replayable has no model "
                                "to instrument)")
    a, b = _Side(ra, states[0], step), _Side(rb, states[1], step)
    if model.param_names(a.cfg.model) != model.param_names(b.cfg.model):
        raise ReplayUnavailable("the runs' models have different parameters; nothing to compare inside a layer")
    out: dict = {"step": step, "found_by": "trace" if focus else "replay", "cause": None, "layer": None,
                 "first_intermediate": None, "programs": {"A": _program_name(a), "B": _program_name(b)},
                 "reproduces_trace": {"A": _reproduces(a), "B": _reproduces(b)}, "notes": []}
    for label, ok in out["reproduces_trace"].items():
        if ok is False:
            out["notes"].append(f"replaying step {step} of {label} here does not give its recorded record: "
                                "the recomputation may not show what the run computed")
    if focus is None:
        # Inputs of the step first: the batch and the dropout key.
        if not np.array_equal(a.inp.hashes, b.inp.hashes):
            n = min(len(a.inp.hashes), len(b.inp.hashes))
            pos = [int(i) for i in np.nonzero(a.inp.hashes[:n] != b.inp.hashes[:n])[0]]
            pos += list(range(n, max(len(a.inp.hashes), len(b.inp.hashes))))
            out.update(cause="data", layer="example_hashes", positions=pos, share_differing=len(pos) / max(1, n))
            return out
        wa, wb = a.rng(), b.rng()
        if not np.array_equal(wa, wb):
            out.update(cause="rng", layer="rng", a=[int(x) for x in wa], b=[int(x) for x in wb])
            return out
    groups = _tensor_groups(a, b)
    if focus is not None:
        target = _target_group(*focus)
        groups = [g for g in groups if g[1] == target]
        if not groups:
            raise ReplayUnavailable(f"no recomputation for the field {focus[1]!r}")
    for kind, group, items in groups:
        first, detail, rows = _walk(items())
        if first is None:
            if focus is not None:
                out["notes"].append(f"recomputed, {focus[1]} is equal in both runs at step {step}: the recorded "
                                    "difference did not reproduce here")
                out.update(cause=focus[0], layer=focus[1], compared=rows)
                return out
            continue
        layer = _layer_of(group, first)
        if focus is not None and layer != focus[1]:
            out["notes"].append(f"recomputed, the first {group} field to differ is {layer}; the trace's is {focus[1]}")
            layer = focus[1]  # the trace's field stays the layer; refinement looks inside it
        out.update(cause=kind, layer=layer, first_intermediate=first, compared=rows)
        if kind == "forward":
            block = layer.split(".")[0]
            if block in model.block_names(a.cfg.model):
                # Inside the block: every intermediate, in execution order.
                fine = model.block_capture_names(a.cfg.model, block)
                first, detail, rows = _walk([(n, (lambda n=n: a.block(block)[n]), (lambda n=n: b.block(block)[n]))
                                             for n in fine])
                out.update(first_intermediate=first, compared=rows)
                if first is None:
                    out["notes"].append(f"the intermediates of {block} are equal in both runs, yet {layer} differs")
            else:
                out["first_intermediate"] = layer
                detail = compare_tensors(a.layers()[layer], b.layers()[layer])
        if detail is not None:
            out.update(distances={k: detail.get(k) for k in ("max_abs", "max_rel", "max_ulp")},
                       share_differing=detail["share_differing"], differing=detail["differing"],
                       elements=detail["elements"], shape=detail["shape"], dtype_a=detail["dtype_a"],
                       dtype_b=detail["dtype_b"], at=detail.get("at"), a_value=detail.get("a_value"),
                       b_value=detail.get("b_value"))
        return out
    out["notes"].append(f"everything step {step} computes is equal in both runs")
    return out


def _reproduces(side: _Side) -> bool | None:
    """Whether replaying the step gives the run's recorded record (None: the step is not recorded)."""
    run = side.r.run
    if side.step not in run.trace:
        return None
    from trainer.recorder import to_record

    _, metrics, hashes = side.after()
    try:
        rec = to_record(side.r.rep.schema, side.step, metrics, hashes)
    except KeyError:  # a recording level without the step fields
        return None
    return not diff_records(run.schema, run.trace.read(side.step), side.r.rep.schema, rec)


def _program_name(side: _Side) -> str:
    return "faulty (layer-bf16)" if side.inp.faulty_program else "the run's own"
