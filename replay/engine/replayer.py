"""Replaying a run on this machine from its own checkpoints, comparing the two runs' states,
and the binary search by replay for the first step whose output state differs (bisect step 5,
sparse traces; see replay/bisect/refine.py).

Replays are counted as *probes*: one probe replays both runs to one step and compares them.
`Replayer.replayed_steps` counts the single steps actually re-run.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from replay.engine.code import code_allowed, is_bundle_run
from traces import Run, TraceError
from replay.engine.damage import shown_path
from replay.errors import InputError, ReplayUnavailable  # noqa: F401 - ReplayUnavailable re-exported
from replay.record import exported
from replay.record.export import _path
from replay.record.exported import flat_state
from replay.record.fingerprint import fingerprint_lanes
from replay.record.orbax_io import CheckpointDamagedError, CheckpointError
from traces.fingerprint import fingerprint


def _input_errors() -> tuple[type[BaseException], ...]:
    """Why a run cannot be opened for replay here, as opposed to a bug: its config, data, mesh,
    files or code (the entry point its manifest names) are missing or do not fit this machine.
    A loop's own errors of that kind subclass replay.errors.InputError (the trainer's config,
    data, mesh and fault errors do)."""
    return TraceError, InputError, OSError, ImportError


def _checkpoint_error() -> type[BaseException]:
    return CheckpointError


# ------------------------------------------------------------------------ opening runs for replay

_CACHE: "OrderedDict[tuple, Any]" = OrderedDict()
_CACHE_SIZE = 6


def open_replayable(run: Run) -> Any:
    """The run's replayable (replay.engine.protocol.load), reused while the run is unchanged: a
    process that bisects several pairs against one run compiles its step once. Keyed by all that
    chooses which replayable `load` returns: the run (folder and manifest), whether it is a
    bundle's, and the --allow-code in force. Without the last, a command with --allow-code got the
    exported program an earlier one opened (and was refused what needs the loop's code), and one
    without it got the loop's code an earlier --allow-code had loaded."""
    from replay.engine.protocol import local_run

    run = local_run(run)  # a remote run: restored from its local copy
    manifest = json.dumps(run.manifest, sort_keys=True, default=str).encode()
    key = (str(Path(run.path).resolve()), hashlib.sha256(manifest).hexdigest(), is_bundle_run(run), code_allowed())
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    from replay.engine.protocol import load

    try:
        rep = load(run)
    except _checkpoint_error():
        raise
    except _input_errors() as e:
        raise ReplayUnavailable(f"{_shown(run)} cannot be replayed here ({type(e).__name__}: {_one_line(e)})") from e
    _CACHE[key] = rep
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return rep


def _shown(run: Run) -> str:
    return shown_path(run)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _copy(tree: Any) -> Any:
    """A copy with fresh buffers: the compiled step donates its input state. Leaves that are not
    JAX arrays (python ints, strings, numpy arrays a loop keeps on the host) are immutable or
    copied on the host. A device array is copied by device_put into a new buffer on its own
    sharding, not `x.copy()`, which compiles a copy program for every leaf shape (7 or 8 of a
    bisect's compiles on the example loops). The sharding is named: without it a typed PRNG key
    replicated over a mesh came back on one device, and the step then refused its state."""
    def copy(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.device_put(x, x.sharding, may_alias=False)
        if isinstance(x, np.ndarray):
            return x.copy()
        return x

    return jax.tree.map(copy, tree)


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
            info = self.run.manifest.get("bundle")
            if isinstance(info, dict) and info.get("lite"):
                raise ReplayUnavailable(f"{_shown(self.run)} is a --lite bundle (trace and report only, no checkpoint "
                                        "or batch data): it cannot be replayed")
            self._rep = open_replayable(self.run)
        return self._rep

    def _initial_state(self) -> Any:
        """The replayable's `initial_state` capability (replay/engine/protocol.py), None without one."""
        return getattr(self.rep, "initial_state", None)

    def checkpoints(self) -> list[int]:
        if self._ckpts is None:
            try:
                steps = list(self.rep.checkpoint_steps())
            except CheckpointDamagedError:
                raise
            except (CheckpointError, OSError) as e:  # none there, or a folder that cannot be listed
                raise ReplayUnavailable(f"{_shown(self.run)}: its checkpoints cannot be read ({_one_line(e)})") from e
            initial = self._initial_state() is not None and 0 not in steps  # step 0 rebuilt, not restored
            self._ckpts = sorted(steps) + ([0] if initial else [])
            self._ckpts.sort()
        return self._ckpts

    def restore(self, k: int) -> Any:
        """The state entering step k from checkpoint k (or, at 0, the run's initial state)."""
        self.restores += 1
        # A checkpoint that does not restore is the checkpoint's error (CheckpointDamagedError
        # names it, exit 2), never "cannot be replayed here": it propagates as itself.
        if k in self.rep.checkpoint_steps():
            return self.rep.restore(k)
        initial = self._initial_state() if k == 0 else None
        if initial is not None:
            return initial()
        raise ReplayUnavailable(f"{_shown(self.run)} has no checkpoint {k}")

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
            raise ReplayUnavailable(f"{_shown(self.run)} has no checkpoint at or before step {k} (checkpoints: {have})")
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
def _device_fingerprints(arrays: list) -> Any:
    return [fingerprint_lanes(x) for x in arrays]


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host_fingerprint(x: Any) -> int:
    """64 bits of a leaf the device cannot fingerprint: an array's bytes (dtype and shape
    included), or the type and repr of a python value (an int, a string, an enum)."""
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        return fingerprint(np.asarray(jax.device_get(x)))
    digest = hashlib.sha256(f"{type(x).__module__}.{type(x).__qualname__}:{x!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _is_flat(state: Any) -> bool:
    return exported._FLAT is not None and isinstance(state, exported._FLAT)


def _alike(sa: Any, sb: Any) -> tuple[Any, Any]:
    """Both states in one form. A run replayed from its exported program carries its state as the
    recorded leaves under their recorded paths (replay/record/exported.py), one replayed with the
    user's code as the user's tree: the same state either way, so the tree side is flattened with
    the paths the recording gave it (the user's tree, flattened, is what was recorded)."""
    flat_a, flat_b = _is_flat(sa), _is_flat(sb)
    if flat_a == flat_b:
        return sa, sb

    def flat(state: Any) -> Any:
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        return flat_state([_path(p) for p, _ in leaves], [x for _, x in leaves])

    return (sa if flat_a else flat(sa)), (sb if flat_b else flat(sb))


def state_fingerprints(state: Any) -> list[tuple[str, int]]:
    """(leaf path, 64-bit fingerprint) of every leaf of the state's parameters and optimizer
    state, in tree order. Arrays are fingerprinted on the device, so only 8 bytes per leaf come
    back; a typed PRNG key by its key data; leaves that are not arrays (a step counter kept as a
    python int, a string) on the host by type and value. None is no leaf (a pytree node)."""
    tree = _comparable(state)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in leaves]
    values: list[int | None] = [None] * len(leaves)
    device: list[tuple[int, Any]] = []
    for i, (_, x) in enumerate(leaves):
        if _is_key(x):
            x = jax.random.key_data(x)
        if isinstance(x, jax.Array):
            device.append((i, x))
        else:
            values[i] = _host_fingerprint(x)
    if device:
        try:
            lanes = jax.device_get(_device_fingerprints([x for _, x in device]))
            for (i, _), l in zip(device, lanes):
                values[i] = (int(l[0]) << 32) | int(l[1])
        except TypeError:  # a dtype the device fingerprint does not take (8-byte without x64): host
            for i, x in device:
                values[i] = _host_fingerprint(x)
    return list(zip(paths, values))


def first_state_difference(sa: Any, sb: Any) -> str | None:
    """The first leaf (tree order) whose fingerprint differs, else None."""
    sa, sb = _alike(sa, sb)
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
