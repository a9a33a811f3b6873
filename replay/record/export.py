"""The recorded step, serialized with `jax.export` into the run, so replay needs no user code.

At the first step `run.step` compiles one program (the user's step plus its record,
replay/record/program.py). The same program is exported here as a function of FLAT leaves,
`fn(*state_leaves, *batch_leaves) -> (*new_state_leaves, *record_values)`: a replay without the
user's code cannot rebuild their pytree classes (a NamedTuple, an optax state, an NNX State),
and `Exported.call` wants the pytree structure it was exported with. Flat leaves need none:
the state is restored from orbax onto the checkpoint's own metadata tree (plain dicts and
lists), matched to the recorded leaves by tree path, and fed in the recorded order.

Typed PRNG keys (an NNX `Rngs` stream, a `jax.random.key` in the state) cross the flat
signature as their raw uint32 words (`jax.random.key_data`, trailing axis of the impl's key
shape): the exported function wraps them back (`jax.random.wrap_key_data(..., impl=...)`)
before the step and unwraps the new state's keys after it, with the impl named in the leaf's
entry. That is also the form orbax stores: it writes a typed key as its uint32 key data, with
the impl in the checkpoint's array metadata (`ext_metadata.random_key_impl`), and restores a
typed key (of that impl) even onto a uint32 target, so a code-free restore gets either form,
checks the impl, and feeds the words.

Files (the manifest's "exported" entry, checksummed with the manifest, holds the signature and
the sha256 of the serialized bytes, so a changed byte in the file is refused before it runs):

    RUN/program/step.jaxexport   Exported.serialize() of the flat function

manifest["exported"] = {"format": 1, "file", "sha256", "bytes", "jax", "platforms", "devices",
  "mesh": None | {"axes": [names], "shape": [sizes], "axis_types": [names], "device_ids": [ids]},
  "state": [{"path", "dtype", "shape", "key"?}], "batch": [{"path", "dtype", "shape"}],
  "record": [record keys, in output order]}, or {"format": 1, "error": why it was not exported}.
A state leaf with "key" (the impl's name, e.g. "threefry2x32") is a typed key; its "dtype" and
"shape" are those of its raw words, as the flat function takes them.

Multi-device steps are exported with the shardings the recorded program was compiled for (its
input shardings; one-device shardings are dropped, the program is then device-agnostic), so
`devices` is the device count the program was partitioned for and `mesh` the NamedSharding mesh
its inputs use. A replay from it needs that many devices (replay/record/exported.py checks it and
rebuilds the mesh). What jax.export cannot carry is refused here, not at replay: a new state of
another structure than the old (the flat function feeds one into the other), duplicate leaf
paths, typed keys in the batch or of an impl jax cannot name, inputs on two different meshes.
The program is exported without donation (donation only reuses buffers; it does not change bits).

Cost: one more trace and lowering of the step at the first call (as long as the record's own,
about a second for a small model); nothing per step. Independent of the run's length.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

FORMAT = 1
FILE = "program/step.jaxexport"
KEY = "exported"


class ExportError(Exception):
    """The step cannot be exported (the run records without an exported program; the reason is kept)."""


def _path(p: tuple) -> str:
    import jax

    return jax.tree_util.keystr(p, simple=True, separator=".")


def _is_key(x: Any) -> bool:
    import jax

    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_impl(x: Any, where: str) -> str:
    """The name `jax.random.wrap_key_data(impl=...)` takes for the typed key (array or abstract) `x`."""
    import jax
    import jax.numpy as jnp

    impl = getattr(getattr(x.dtype, "_impl", None), "name", None)  # a ShapeDtypeStruct has no key_impl()
    if impl is None and isinstance(x, jax.Array):
        impl = str(jax.random.key_impl(x))
    try:  # a custom impl has no name wrap_key_data knows: check it round-trips
        raw = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        words = jax.ShapeDtypeStruct(raw.shape, jnp.uint32)
        ok = jax.eval_shape(lambda w: jax.random.wrap_key_data(w, impl=impl), words)
        ok = ok.dtype == x.dtype
    except Exception:  # noqa: BLE001 - whatever wrap_key_data refuses
        ok = False
    if not ok:
        raise ExportError(f"{where} is a typed PRNG key of an impl jax.random.wrap_key_data cannot name ({x.dtype}); "
                          "an exported program rebuilds keys by impl name: use a built-in impl (threefry2x32, rbg, "
                          "unsafe_rbg)")
    return impl


def _leaf_specs(tree: Any, what: str) -> list[dict]:
    import jax
    import numpy as np

    out = []
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = _path(p) or what
        if _is_key(x):
            if what != "state":
                raise ExportError(f"{what} leaf {name} is a typed PRNG key; an exported program rebuilds batches from "
                                  "stored rows: feed its raw words (jax.random.key_data) and wrap them inside the step")
            raw = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
            impl = key_impl(x, f"{what} leaf {name}")
            out.append({"path": _path(p), "dtype": "uint32", "shape": list(raw.shape), "key": impl})
            continue
        out.append({"path": _path(p), "dtype": np.dtype(x.dtype).name, "shape": list(x.shape)})
    names = [s["path"] for s in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ExportError(f"two {what} leaves share the tree path {dup!r}; an exported program names leaves by path")
    return out


def flat_program(program: Any, state: Any, batch: Any, impls: list[str | None] | None = None) -> tuple[Any, list[str]]:
    """(the flat function of the recorded program, its record keys once traced). `impls[i]` names
    the key impl of state leaf i (None: not a key); that leaf is taken and returned as raw words."""
    import jax

    state_def = jax.tree_util.tree_structure(state)
    batch_def = jax.tree_util.tree_structure(batch)
    n = state_def.num_leaves
    impls = list(impls) if impls is not None else [None] * n
    record_keys: list[str] = []

    def flat(*leaves):
        state_leaves = [x if impl is None else jax.random.wrap_key_data(x, impl=impl)
                        for x, impl in zip(leaves[:n], impls)]
        s = jax.tree_util.tree_unflatten(state_def, state_leaves)
        b = jax.tree_util.tree_unflatten(batch_def, leaves[n:])
        new_state, _metrics, record = program._program(s, b)
        new_leaves, new_def = jax.tree_util.tree_flatten(new_state)
        if new_def != state_def:
            raise ExportError("the step returns a state of another tree structure than it takes; an exported "
                              "program feeds one step's state into the next")
        out = []
        for i, (x, impl) in enumerate(zip(new_leaves, impls)):
            if (impl is not None) != _is_key(x) or (impl is not None and x.dtype != state_leaves[i].dtype):
                raise ExportError(f"new state leaf {i} is {x.dtype} where the state entering the step holds "
                                  f"{state_leaves[i].dtype}; an exported program feeds one step's state into the next")
            out.append(x if impl is None else jax.random.key_data(x))
        record_keys[:] = list(record)
        return (*out, *(record[k] for k in record_keys))

    return flat, record_keys


def _input_shardings(program: Any) -> list[Any]:
    """Per flat input leaf, the sharding the recorded program was compiled for (None: one device)."""
    import jax

    compiled = getattr(program, "_compiled", None)
    shardings = None
    if compiled is not None:
        try:
            shardings = jax.tree.leaves(compiled.input_shardings[0])
        except Exception:  # noqa: BLE001 - an executable that cannot say: the abstract inputs' own
            shardings = None
    if shardings is None or len(shardings) != len(jax.tree.leaves(program.abstract)):
        shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(program.abstract)]
    return [s if s is not None and len(s.device_set) > 1 else None for s in shardings]


def mesh_of(shardings: list[Any]) -> dict | None:
    """The manifest's description of the one mesh the NamedShardings among `shardings` use."""
    import jax

    meshes = {}
    for s in shardings:
        if isinstance(s, jax.sharding.NamedSharding):
            m = s.mesh
            meshes[(tuple(m.axis_names), tuple(m.devices.shape), tuple(str(t).split(".")[-1] for t in m.axis_types),
                    tuple(int(d.id) for d in m.devices.flat))] = None
    if len(meshes) > 1:
        raise ExportError("the step's inputs are placed on more than one device mesh; an exported program "
                          "rebuilds one mesh at replay: put every input on the same mesh")
    if not meshes:
        return None
    axes, shape, types, ids = next(iter(meshes))
    return {"axes": list(axes), "shape": list(shape), "axis_types": list(types), "device_ids": list(ids)}


def _raw_spec(x: Any, sharding: Any) -> Any:
    import jax

    if _is_key(x):
        raw = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jax.ShapeDtypeStruct(raw.shape, raw.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def export(run_path: Path, program: Any) -> dict:
    """Exports the compiled `program` (Program.compile has run) into the run; the manifest entry.

    Never raises for what jax.export cannot do: the entry then says why, and replay of that run
    needs the user's code."""
    import jax
    from jax import export as jexport

    try:
        state, batch = program.abstract
        entry = {"format": FORMAT, "state": _leaf_specs(state, "state"), "batch": _leaf_specs(batch, "batch")}
        shardings = _input_shardings(program)
        mesh = mesh_of(shardings)
        flat, record_keys = flat_program(program, state, batch, [s.get("key") for s in entry["state"]])
        args = [_raw_spec(x, s) for x, s in zip([*jax.tree.leaves(state), *jax.tree.leaves(batch)], shardings)]
        exported = jexport.export(jax.jit(flat))(*args)
        data = bytes(exported.serialize())
    except ExportError as e:
        return {"format": FORMAT, "error": str(e)}
    except Exception as e:  # noqa: BLE001 - whatever jax.export refuses: recorded, the run still records
        return {"format": FORMAT, "error": f"jax.export cannot serialize this step ({type(e).__name__}: "
                                           f"{' '.join(str(e).split())[:300]})"}
    target = Path(run_path) / FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(target)
    entry.update(file=FILE, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), jax=jax.__version__,
                 platforms=list(exported.platforms), devices=int(exported.nr_devices),
                 mesh=mesh if int(exported.nr_devices) > 1 else None, record=list(record_keys))
    return entry
