"""The recorded step, serialized with `jax.export` into the run, so replay needs no user code.

At the first step `run.step` compiles one program (the user's step plus its record,
replay/record/program.py). The same program is exported here as a function of FLAT leaves,
`fn(*state_leaves, *batch_leaves) -> (*new_state_leaves, *record_values)`: a replay without the
user's code cannot rebuild their pytree classes (a NamedTuple, an optax state, an NNX State),
and `Exported.call` wants the pytree structure it was exported with. Flat leaves need none:
the state is restored from orbax onto the checkpoint's own metadata tree (plain dicts and
lists), matched to the recorded leaves by tree path, and fed in the recorded order.

Files (the manifest's "exported" entry, checksummed with the manifest, holds the signature and
the sha256 of the serialized bytes, so a changed byte in the file is refused before it runs):

    RUN/program/step.jaxexport   Exported.serialize() of the flat function

manifest["exported"] = {"format": 1, "file", "sha256", "bytes", "jax", "platforms", "devices",
  "state": [{"path", "dtype", "shape"}], "batch": [{"path", "dtype", "shape"}],
  "record": [record keys, in output order]}, or {"format": 1, "error": why it was not exported}.

What jax.export cannot carry is refused here, not at replay: a state whose new state has another
structure than the old (the flat function feeds one into the other), duplicate leaf paths, and
typed PRNG keys in the state (orbax stores them in a form a code-free restore cannot rebuild:
keep raw uint32 key words in the state, as examples/optax_loop.py does). The program is exported
without donation (donation only reuses buffers; it does not change bits) and with the shardings
of the recorded inputs (a replay needs the same device count; it is checked).
"""

from __future__ import annotations

import hashlib
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


def _leaf_specs(tree: Any, what: str) -> list[dict]:
    import jax
    import numpy as np

    out = []
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _is_key(x):
            raise ExportError(f"{what} leaf {_path(p) or what} is a typed PRNG key; an exported program restores "
                              "checkpoints without your code and cannot rebuild typed keys: keep the raw uint32 "
                              "words in the state (jax.random.key_data) and wrap them inside the step")
        out.append({"path": _path(p), "dtype": np.dtype(x.dtype).name, "shape": list(x.shape)})
    names = [s["path"] for s in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ExportError(f"two {what} leaves share the tree path {dup!r}; an exported program names leaves by path")
    return out


def flat_program(program: Any, state: Any, batch: Any) -> tuple[Any, list[str]]:
    """(the flat function of the recorded program, its record keys once traced)."""
    import jax

    state_def = jax.tree_util.tree_structure(state)
    batch_def = jax.tree_util.tree_structure(batch)
    n = state_def.num_leaves
    record_keys: list[str] = []

    def flat(*leaves):
        s = jax.tree_util.tree_unflatten(state_def, leaves[:n])
        b = jax.tree_util.tree_unflatten(batch_def, leaves[n:])
        new_state, _metrics, record = program._program(s, b)
        new_leaves, new_def = jax.tree_util.tree_flatten(new_state)
        if new_def != state_def:
            raise ExportError("the step returns a state of another tree structure than it takes; an exported "
                              "program feeds one step's state into the next")
        record_keys[:] = list(record)
        return (*new_leaves, *(record[k] for k in record_keys))

    return flat, record_keys


def export(run_path: Path, program: Any) -> dict:
    """Exports the compiled `program` (Program.compile has run) into the run; the manifest entry.

    Never raises for what jax.export cannot do: the entry then says why, and replay of that run
    needs the user's code."""
    import jax
    from jax import export as jexport

    try:
        state, batch = program.abstract
        entry = {"format": FORMAT, "state": _leaf_specs(state, "state"), "batch": _leaf_specs(batch, "batch")}
        flat, record_keys = flat_program(program, state, batch)
        args = [*jax.tree.leaves(state), *jax.tree.leaves(batch)]
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
        import os

        os.fsync(f.fileno())
    tmp.replace(target)
    entry.update(file=FILE, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), jax=jax.__version__,
                 platforms=list(exported.platforms), devices=int(exported.nr_devices), record=list(record_keys))
    return entry
