"""What a recorded step is given, before replay/record/program.py traces it: a `jax.jit` step
unwrapped to its Python function and the jit options to keep, the state checked to hold arrays
only, and the abstract inputs (shape, dtype, sharding) the program is lowered for, placed as the
step's jit places them.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from replay.record.errors import RecordError


def leaf_name(path: tuple, sep: str = ".") -> str:
    import jax

    return jax.tree_util.keystr(path, simple=True, separator=sep)


def unwrap(step: Callable) -> tuple[Callable, dict]:
    """(the Python function, jit options to keep) of a `jax.jit` step; a plain function as is."""
    if type(step).__name__ == "_JitWrapper" and type(step).__module__.startswith("equinox"):
        # eqx.filter_jit: its inner jit would refuse the step's taps; keep its donation only.
        return step.__wrapped__, ({"donate_argnums": (0,)} if getattr(step, "donate_first", False) else {})
    info = getattr(step, "_jit_info", None)
    fn = getattr(step, "__wrapped__", None)
    if info is None or fn is None:
        if not callable(step):
            raise RecordError(f"run.step wraps a step function; got {type(step).__name__}")
        return step, {}
    if info.static_argnums or info.static_argnames:
        raise RecordError("run.step: the jitted step has static arguments; a recorded step is (state, batch) -> "
                          "(state, metrics), so bind the static ones first (functools.partial, then jax.jit)")
    import jax

    opts: dict = {}
    if info.donate_argnums:
        opts["donate_argnums"] = tuple(info.donate_argnums)
    if info.user_specified_in_shardings:
        opts["in_shardings"] = jax.tree_util.tree_unflatten(info.in_shardings_treedef, info.in_shardings_leaves)
    leaves = info.out_shardings_leaves
    if any(type(s).__name__ != "UnspecifiedValue" for s in leaves):
        opts["out_shardings"] = jax.tree_util.tree_unflatten(info.out_shardings_treedef, leaves)
    return fn, opts


def check_state(state: Any) -> None:
    import jax

    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            raise RecordError(f"state leaf {leaf_name(path) or 'state'} is a {type(leaf).__name__}, not an array; a "
                              "recorded state holds arrays only (make it jnp.asarray(...), or keep it out of the state)")


def spec(x: Any) -> Any:
    """The abstract value a program is lowered for: shape, dtype and, for device arrays, sharding."""
    import jax

    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    sharding = x.sharding if isinstance(x, jax.Array) else None
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def replicated(abstract: tuple) -> Any:
    """A sharding replicated over the program's devices, for the small rows chained from step to
    step; None when the inputs' layout does not say one (the program then measures the entering
    state itself, every step)."""
    import jax

    shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(abstract)]
    named = [s for s in shardings if isinstance(s, jax.sharding.NamedSharding)]
    if named:
        return jax.sharding.NamedSharding(named[0].mesh, jax.sharding.PartitionSpec())
    placed = [s for s in shardings if s is not None]  # None: a host array, placed on the default device
    if not placed:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if all(isinstance(s, jax.sharding.SingleDeviceSharding) for s in placed) \
            and len({next(iter(s.device_set)) for s in placed}) == 1:
        return placed[0]
    return None


def placed(abstract: tuple, jit_options: dict) -> tuple:
    """The inputs as the step's jit places them: a host array (a replayed batch_at's numpy rows)
    takes the step's in_shardings, as the array the loop fed while recording had them, so the
    step traces for the same types (under explicit sharding a type carries its sharding) and
    compiles to the same program."""
    import jax

    given = jit_options.get("in_shardings")
    if not isinstance(given, (tuple, list)) or len(given) != len(abstract):
        return abstract
    out = []
    for tree, sharding in zip(abstract, given):
        if isinstance(sharding, jax.sharding.Sharding):
            tree = jax.tree.map(lambda x, s=sharding: x if x.sharding is not None
                                else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree)
        out.append(tree)
    return tuple(out)


def without_one_device_sharding(x: Any) -> Any:
    import jax

    sharding = getattr(x, "sharding", None)
    if sharding is not None and len(sharding.device_set) == 1:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x
