"""`replay.tap(tree, name)`: fingerprint a tree the step computes (gradients, activations).

A tap returns its tree unchanged. While the recording wrapper traces the step (at record time
and again at replay, through the run's `replay.Loop`), it also collects the tree, and the
wrapper fingerprints every leaf into the record, named `NAME/<leaf path>`. Outside that trace
(the step called unwrapped) a tap does nothing, so a step keeps working without replay.

The kind (where the tree sits in causal order) comes from the name unless given: names starting
with "grad" are `backward`, "rng" means the leaves are RNG key words (typed keys or uint32) that
join the record's RNG words, anything else is `forward`.

Order: a tap's leaves are recorded in the order the step computes them, not in `jax.tree`'s order
(which sorts a dict's keys: block_0, block_1, embed, head): the recorded step traces the step
once more as a jaxpr and orders each tap's leaves by the equation that produces them
(replay/record/program.py `tap_order`), so a dict of layer outputs comes in forward order and
gradients in the order backpropagation computes them (the last layer's first), and "the first
differing layer" follows execution. Leaves produced by one equation (an inner jit's outputs)
keep jax.tree's order among themselves.

Limitation: call it at the top level of the step function, on values the step itself holds, not
inside a function that JAX transforms separately (`jax.grad`'s loss function, `scan`, `vmap`, an
inner `jit`): a value from inside one of those cannot leave it. Return activations from the loss
function as aux (`has_aux=True`) and tap them after `value_and_grad`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from replay.record.errors import RecordError

KINDS = ("forward", "backward", "rng")
_active = threading.local()


def kind_of(name: str, kind: str | None) -> str:
    if kind is None:
        return "backward" if name.startswith("grad") else "rng" if name.startswith("rng") else "forward"
    if kind not in KINDS:
        raise RecordError(f"replay.tap({name!r}, kind={kind!r}): kind must be one of {', '.join(KINDS)}")
    return kind


def tap(tree: Any, name: str, kind: str | None = None) -> Any:
    """Returns `tree`; while a recorded step is traced, also records its leaves' fingerprints."""
    taps = getattr(_active, "taps", None)
    if not isinstance(name, str) or not name or "/" in name:
        raise RecordError(f"replay.tap: the name {name!r} must be a non-empty string without '/'")
    kind = kind_of(name, kind)
    if taps is not None:
        if any(n == name for n, _, _ in taps):
            raise RecordError(f"replay.tap: the step taps {name!r} twice; give each tap its own name")
        taps.append((name, kind, tree))
    return tree


def is_collecting() -> bool:
    """Whether a recorded step is being traced here now (a `replay.tap` would record)."""
    return getattr(_active, "taps", None) is not None


@contextlib.contextmanager
def collecting():
    """Collects the taps made while the body runs (the wrapper's trace of the step)."""
    outer = getattr(_active, "taps", None)
    _active.taps = taps = []
    try:
        yield taps
    finally:
        _active.taps = outer


def tap_leaves(tree: Any, name: str, order: list[int] | None = None) -> list[tuple[str, Any]]:
    """(NAME/leaf path, leaf) of a tapped tree, in `order` (positions in jax.tree's order; None:
    that order): how the recorded step names and orders its tensors."""
    import jax

    leaves = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        p = jax.tree_util.keystr(path, simple=True, separator=".")
        leaves.append((f"{name}/{p}" if p else name, x))
    if order is None or sorted(order) != list(range(len(leaves))):
        return leaves
    return [leaves[i] for i in order]


def tap_order(fn: Any, args: tuple) -> dict[str, list[int]]:
    """{forward or backward tap name: its leaves' positions in jax.tree's order, sorted by the
    equation of the step (traced once as a jaxpr on `args`) that produces each}; {} when the step
    cannot be traced that way (the taps then keep jax.tree's order). Cost: one trace of the step."""
    import jax

    tapped: list[tuple[str, int]] = []

    def probe(*a: Any) -> list:
        with collecting() as taps:
            fn(*a)
        kept = [(name, tree) for name, kind, tree in taps if kind in ("forward", "backward")]
        tapped[:] = [(name, len(jax.tree.leaves(tree))) for name, tree in kept]
        return [jax.tree.leaves(tree) for _, tree in kept]

    try:
        jaxpr = jax.make_jaxpr(probe)(*args).jaxpr
    except Exception:  # noqa: BLE001 - the order is a refinement; the recorded step's own trace reports errors
        return {}
    produced = {id(v): i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    order, at = {}, 0
    for name, n in tapped:
        made = [produced.get(id(v), -1) for v in jaxpr.outvars[at:at + n]]  # -1: an input, known before any op
        order[name] = sorted(range(n), key=lambda j: (made[j], j))
        at += n
    return order
