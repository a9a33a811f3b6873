"""Cheap, read-only checks of the checkpoints a run lists, without restoring them.

`replay bisect` uses this when the traces agree: it never calls two runs identical while one of
them lists a checkpoint that is missing or structurally damaged.

Checked, for each checkpoint the manifest lists ("checkpoints"): its folder exists. An orbax
checkpoint: orbax's commit record (_CHECKPOINT_METADATA) and each item's _METADATA parse as
JSON; each OCDBT item's manifest and B-tree nodes are read (tensorstore checks their CRC-32C)
and, for every stored value, its last byte is read from its data file, so a missing,
truncated or unreadable data file is found. A torch checkpoint (replay.torch): every file its
manifest records ("checkpoint_files") exists.

Not checked: the array bytes themselves. Orbax's data chunks carry no checksum; only restoring
the state and recomputing its fingerprint (`replay run`, `train --resume`, a bisect replay)
checks them, and that reads the whole state onto devices (a 7B model with Adam: ~84 GB a
checkpoint), so a verdict built on this check says the contents were not compared.

Cost: per checkpoint a few small JSON files, the OCDBT manifest and B-tree nodes (KBs) and one
1-byte read per stored chunk: O(chunks), no array bytes, whatever the model's size. At a million
steps it is the checkpoints the run keeps (checkpoint.keep), milliseconds each (the tiny
preset's three checkpoints: 7-10 ms in all, ~46 ms on the first call of a process, which loads
tensorstore; measured on this 2-core machine). No JAX.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COMMIT_RECORD = "_CHECKPOINT_METADATA"
ITEM_METADATA = "_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
TORCH_FILES_KEY = "checkpoint_files"  # replay/torch/checkpoint.py's FILES_KEY (no torch import here)
_WHAT_TO_DO = "restore from another checkpoint or re-create the run"


def checkpoint_root(run: Any) -> Path:
    """Where the run's checkpoints are: RUN/checkpoints, or the folder replay.init recorded."""
    where = run.manifest.get("checkpoint_dir", "checkpoints")
    return Path(where) if Path(where).is_absolute() else Path(run.path) / where


def listed_checkpoints(run: Any) -> list[int]:
    steps = run.manifest.get("checkpoints") or []
    return [int(k) for k in steps if isinstance(k, int) and not isinstance(k, bool)]


def checkpoint_problem(run: Any) -> str | None:
    """One line naming the first listed checkpoint of `run` that is missing or structurally
    damaged ("RUN/checkpoints/K: checkpoint K is damaged (...); ..."), or None."""
    root = checkpoint_root(run)
    torch_files = run.manifest.get(TORCH_FILES_KEY)
    for step in listed_checkpoints(run):
        folder = root / str(step)
        files = torch_files.get(str(step)) if isinstance(torch_files, dict) else None
        problem = _problem(folder, files)
        if problem:
            return f"{folder}: checkpoint {step} is damaged ({problem}); {_WHAT_TO_DO}"
    return None


def _problem(folder: Path, torch_files: Any) -> str | None:
    if not folder.is_dir():
        return "its folder is missing" if not folder.exists() else "it is not a folder"
    if isinstance(torch_files, dict):
        missing = [name for name in torch_files if not (folder / name).is_file()]
        return f"{missing[0]} is missing" if missing else None
    commit = _json_problem(folder / COMMIT_RECORD)
    if commit:
        return commit
    items = [p for p in sorted(folder.iterdir()) if p.is_dir() and not p.name.startswith(".")]
    if not items:
        return "it holds no saved item"
    for item in items:
        if (item / OCDBT_MANIFEST).exists() or (item / ITEM_METADATA).exists():  # a pytree item (orbax's layout)
            problem = _json_problem(item / ITEM_METADATA) or (_ocdbt_problem(item) if (item / OCDBT_MANIFEST).exists()
                                                               else None)
        else:  # another handler's item (a data iterator's JSON state, grain's): its files, its JSON parses
            problem = _other_item_problem(item)
        if problem:
            return problem
    return None


def _other_item_problem(item: Path) -> str | None:
    files = [p for p in sorted(item.rglob("*")) if p.is_file()]
    if not files:
        return f"{item.name} holds no file"
    for path in files:
        if path.suffix == ".json" or path.name == "metadata":
            problem = _json_problem(path)
            if problem:
                return problem
    return None


def _json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_text())
    except FileNotFoundError:
        return f"{path.parent.name}/{path.name} is missing"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{path.parent.name}/{path.name} is unreadable: {_short(e)}"
    return None


def _ocdbt_problem(item: Path) -> str | None:
    import tensorstore as ts

    try:
        # A context of its own: nothing cached from another open of these files answers for them.
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item.absolute()}/"}, context=ts.Context()).result()
        keys = kv.list().result()
        reads = [kv.read(key, byte_range=slice(-1, None)) for key in keys]
        for key, read in zip(keys, reads):
            got = read.result()
            # A data file that is gone or cut short reads as a short value, not as an error.
            if got.state != "value" or len(got.value) != 1:
                return f"{item.name}: the data of {key.decode(errors='replace')} is missing or cut short"
    except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError and others for unreadable files
        return f"{item.name}: {_short(e)}"
    return None


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 160 else text[:157].rsplit(" ", 1)[0] + " ..."
