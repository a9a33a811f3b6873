"""Where a restored array goes when the loop does not say: where it was when it was saved.

A `replay.Loop` gives its state's shapes (`abstract_state`, or `init` whose shapes jax.eval_shape
finds); neither need carry shardings (eval_shape drops those an `init` sets with device_put or a
sharding constraint). Placed by default on the first device, a state saved replicated over a
mesh would meet batches the loop shards over that mesh, and the step would refuse arguments on
different devices. So a leaf the Loop gives no sharding takes the one orbax recorded with the
checkpoint (its mesh shape, axis names, device ids and partition spec), when those devices exist
here; when they do not but as many devices do (a run of several processes, whose CPU device ids
are per process, replayed by one process), the same mesh on this machine's first devices in
order; otherwise the first device, as before.

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
        except Exception:  # noqa: BLE001 - saved on devices this machine lacks
            sharding = _same_mesh_here(meta)  # e.g. a run of several processes replayed in one
            if sharding is None:
                continue  # the default placement
        out[_path(path)] = sharding
    return out


def _same_mesh_here(meta: Any) -> Any:
    """The saved NamedSharding's mesh shape, axis names and partition spec on this machine's first
    devices in order, when it has as many as the mesh held (a run of several processes, whose
    device ids are per process, replayed by one; or another machine with the same count); None
    otherwise."""
    import jax
    import numpy as np

    shape, names = getattr(meta, "shape", None), getattr(meta, "axis_names", None)
    spec = getattr(meta, "partition_spec", None)
    if shape is None or names is None or spec is None:
        return None
    n = int(np.prod(shape))
    if n > jax.device_count():
        return None
    try:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(tuple(shape)), tuple(names))
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    except Exception:  # noqa: BLE001 - a layout that cannot be rebuilt here: the default placement
        return None


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
