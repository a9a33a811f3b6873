"""Where a restored array goes when the loop does not say: where it was when it was saved.

A `replay.Loop` gives its state's shapes (`abstract_state`, or `init` whose shapes jax.eval_shape
finds); neither need carry shardings (eval_shape drops those an `init` sets with device_put or a
sharding constraint). Placed by default on the first device, a state saved replicated over a
mesh would meet batches the loop shards over that mesh, and the step would refuse arguments on
different devices. So a leaf the Loop gives no sharding takes the one orbax recorded with the
checkpoint (its mesh shape, axis names, device ids and partition spec), when those devices exist
here; otherwise the first device, as before.

Cost: reads the checkpoint's metadata file once per restore (no array data).
"""

from __future__ import annotations

from typing import Any


def _path(path: tuple) -> str:
    import jax

    return jax.tree_util.keystr(path, simple=True, separator="/")


def saved_shardings(metadata: Any) -> dict[str, Any]:
    """{leaf path: jax sharding} of the checkpoint metadata tree's leaves whose recorded sharding
    can be built on this machine's devices (paths as keystr(simple) with "/": a NamedTuple field
    and a dict key of the same name match)."""
    import jax

    if metadata is None:
        return {}
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(metadata, is_leaf=lambda x: hasattr(x, "sharding"))[0]
    for path, leaf in leaves:
        meta = getattr(leaf, "sharding", None)
        if meta is None:
            continue
        try:
            sharding = meta.to_jax_sharding()
        except Exception:  # noqa: BLE001 - saved on devices this machine lacks: the default placement
            continue
        out[_path(path)] = sharding
    return out


def with_saved_shardings(abstract: Any, given: set[str], saved: dict[str, Any]) -> Any:
    """`abstract` (ShapeDtypeStruct leaves) with each leaf not in `given` (the paths whose sharding
    the Loop gave) on its saved sharding where one is known."""
    import jax

    def leaf(path: tuple, s: Any) -> Any:
        key = _path(path)
        if key in given or key not in saved:
            return s
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=saved[key])

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def given_shardings(abstract_state: Any) -> set[str]:
    """The paths of a Loop's abstract_state whose leaves carry a sharding (none for an `init`)."""
    import jax

    if abstract_state is None:
        return set()
    return {_path(p) for p, s in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
            if getattr(s, "sharding", None) is not None}
