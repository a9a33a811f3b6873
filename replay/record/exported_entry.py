"""Checking the manifest's "exported" and "example_store" entries before a replay believes them.

The manifest checksum (traces/run.py) only proves run.json is what some writer wrote: a crafted or
hand-edited run.json with a fresh checksum passes it. Every key the code-free replay and `pack`
read from these entries (replay/record/exported.py, examples_store.py) is checked here for its
type and range first, so a missing sha256 or a file named "../x" is one line (exit 2), never a
KeyError (exit 3) or a path outside the run. Cost: one pass over the entries' leaf lists.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.record import examples_store
from replay.record import export as exportlib
from pathlib import PurePosixPath
import math


def _is_int(x: Any, low: int = 0) -> bool:
    return type(x) is int and x >= low  # not a bool: True is no device count


def _is_strs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def _inside(name: Any) -> bool:
    """A relative path that stays inside the run (pack writes it into a bundle's folder)."""
    p = PurePosixPath(name) if isinstance(name, str) and name and "\\" not in name and "\0" not in name else None
    return p is not None and not p.is_absolute() and ".." not in p.parts


def _leaves_damage(leaves: Any, what: str, parse_dtype: bool = False) -> str | None:
    if not isinstance(leaves, list):
        return f"{what} is not a list"
    for i, s in enumerate(leaves):
        if not isinstance(s, dict) or not isinstance(s.get("path"), str) or not isinstance(s.get("dtype"), str):
            return f"{what}[{i}] has no path or dtype"
        if not isinstance(s.get("shape"), list) or not all(_is_int(d) for d in s["shape"]):
            return f"{what}[{i}] ({s['path']}) has no shape of non-negative integers"
        if "key" in s and not isinstance(s["key"], str):
            return f"{what}[{i}] ({s['path']}) names its key impl with a {type(s['key']).__name__}"
        if parse_dtype:
            try:
                dt = np.dtype(s["dtype"])
            except TypeError:
                dt = None
            if dt is None or dt.hasobject or dt.itemsize == 0:  # rows are raw bytes of a fixed-size dtype
                return f"{what}[{i}] ({s['path']}) has dtype {s['dtype'][:40]!r}, not a numeric dtype numpy knows"
    paths = [s["path"] for s in leaves]
    if len(set(paths)) != len(paths):
        return f"{what} names a leaf twice"
    return None


def _axis_types() -> Any:
    import jax

    return jax.sharding.AxisType


def entry_damage(manifest: dict) -> tuple[str, str] | None:
    """(the entry, what is wrong) when the manifest's "exported" or "example_store" entry is not as
    replay/record/export.py and examples_store.py write it (every key the replay reads, its type); None
    when both are well formed. An entry saying why the step was not exported is well formed."""
    entry, key = manifest.get(exportlib.KEY), exportlib.KEY
    if not isinstance(entry, dict):
        return key, f"a {type(entry).__name__}, not an object"
    if entry.get("format") != exportlib.FORMAT or not _is_int(entry.get("format")):
        return key, f"format {entry.get('format')!r}, this replay reads format {exportlib.FORMAT}"
    if "error" in entry:
        return None if isinstance(entry["error"], str) and entry["error"] else (key, "an empty or non-text error")
    checks = [
        ("file", _inside(entry.get("file")), "a relative path inside the run"),
        ("sha256", isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64
         and all(c in "0123456789abcdef" for c in entry["sha256"]), "64 hex digits"),
        ("bytes", _is_int(entry.get("bytes")), "a byte count"), ("jax", isinstance(entry.get("jax"), str), "text"),
        ("platforms", _is_strs(entry.get("platforms")), "a list of names"),
        ("devices", _is_int(entry.get("devices"), 1), "a device count of 1 or more"),
        ("record", _is_strs(entry.get("record")), "a list of record keys"),
    ]
    for name, ok, want in checks:
        if not ok:
            return key, f"{name} is {'missing' if name not in entry else repr(entry[name])[:60]}, not {want}"
    for what in ("state", "batch"):
        why = _leaves_damage(entry.get(what), what)
        if why:
            return key, why
    mesh = entry.get("mesh")
    if mesh is not None:
        if not isinstance(mesh, dict) or not _is_strs(mesh.get("axes")) or not isinstance(mesh.get("shape"), list) \
                or not all(_is_int(d, 1) for d in mesh["shape"]) or len(mesh["shape"]) != len(mesh["axes"]) \
                or math.prod(mesh["shape"]) != entry["devices"]:
            return key, f"its mesh {str(mesh)[:80]} is not axes and sizes over {entry['devices']} devices"
        types, ids = mesh.get("axis_types"), mesh.get("device_ids")
        if types and (not _is_strs(types) or len(types) != len(mesh["axes"])
                      or not all(isinstance(getattr(_axis_types(), t, None), _axis_types()) for t in types)):
            return key, f"its mesh's axis_types {str(types)[:60]} are not jax.sharding.AxisType names, one per axis"
        if ids and (not isinstance(ids, list) or not all(_is_int(i) for i in ids)):
            return key, f"its mesh's device_ids {str(ids)[:60]} are not device numbers"
    store, key = manifest.get(examples_store.KEY), examples_store.KEY
    if store is None:
        return None
    if not isinstance(store, dict):
        return key, f"a {type(store).__name__}, not an object"
    if not store.get("leaves"):
        return None  # no store: said by usable()
    if "file" in store and not _inside(store["file"]):
        return key, f"file {str(store['file'])[:60]!r} is not a relative path inside the run"
    if "batch_axis" in store and not _is_int(store["batch_axis"]):
        return key, f"batch_axis {str(store['batch_axis'])[:20]!r} is not an axis number"
    why = _leaves_damage(store["leaves"], "leaves", parse_dtype=True)
    return (key, why) if why else None
