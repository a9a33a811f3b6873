"""What `replay.init` writes into run.json: config, environment, command line, code version,
dataset size, and which function rebuilds the loop for replay (by module, not by file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from replay.record.errors import RecordError


class Tokens:
    """`replay.init(dataset_size=replay.Tokens(T))`: the dataset counted in tokens, for packed LM
    rows (each row a window of the token stream, so a number of rows is not what an epoch is).
    `replay audit` takes epochs of T // L rows, L a row's tokens: the per-example size of the
    batch's first integer leaf, recorded at the first step (run.json "example_tokens")."""

    def __init__(self, count: int):
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise RecordError(f"replay.Tokens({count!r}): the dataset's number of tokens, an int > 0")
        self.count = count

    def __repr__(self) -> str:
        return f"replay.Tokens({self.count})"


def example_tokens(manifest: dict, batch: Any, batch_axis: int) -> dict:
    """{"example_tokens": L} for a run whose dataset size was given in tokens (else {}): L is the
    per-example size of the batch's first integer leaf (ShapeDtypeStructs or arrays)."""
    if manifest.get("dataset_tokens") is None:
        return {}
    import jax
    import numpy as np

    for leaf in jax.tree.leaves(batch):
        if np.issubdtype(np.dtype(leaf.dtype), np.integer) and len(leaf.shape) > batch_axis:
            return {"example_tokens": int(np.prod(leaf.shape)) // int(leaf.shape[batch_axis])}
    raise RecordError("replay.init(dataset_size=replay.Tokens(...)): the batch has no integer leaf to count an "
                      "example's tokens in; give dataset_size as a number of examples")


FACTORY = "replay.record.replayable:from_run"  # trusted: replay's own, it imports the user's entry point
RECORDED_BY = "replay.init"


def entrypoint_spec(entrypoint: str | Callable) -> tuple[str, str | None]:
    """("module:function", folder to import it from or None) for the manifest.

    A string is taken as is (the module is installed). A function gives its module and name; a
    function of a script run as `python path/train.py` (module __main__) is named by the file's
    stem, with the script's folder recorded: replaying imports from that folder only when asked
    (`--allow-code`), never from a bundle (replay/engine/code.py)."""
    if isinstance(entrypoint, str):
        module, sep, attr = entrypoint.partition(":")
        if not sep or not module or not attr:
            raise RecordError(f"replay.init(entrypoint={entrypoint!r}): name it as 'module:function'")
        return entrypoint, None
    if not callable(entrypoint):
        raise RecordError(f"replay.init(entrypoint=...): pass the @replay.entrypoint function or 'module:function', "
                          f"not {type(entrypoint).__name__}")
    module, qual = getattr(entrypoint, "__module__", None), getattr(entrypoint, "__qualname__", "")
    if not module or "<" in qual:
        raise RecordError("replay.init(entrypoint=...): the entry point must be a module-level function")
    if module == "__main__":
        file = getattr(sys.modules["__main__"], "__file__", None)
        if not file:
            raise RecordError("replay.init(entrypoint=...): a function defined interactively cannot be imported at "
                              "replay; define it in a module")
        return f"{Path(file).stem}:{qual}", str(Path(file).resolve().parent)
    return f"{module}:{qual}", None


def git_commit(where: Path) -> dict | None:
    """{"commit", "dirty"} of the git checkout holding `where`, None outside one (or without git)."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=5,
                                  check=True).stdout.strip()

        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


# Keys replay writes itself (here, at the first step and with every checkpoint): never a loop's extra key.
REPLAY_KEYS = ("format_version", "recorded_by", "replayable", "entrypoint", "entrypoint_path", "config", "environment",
            "argv", "checkpoint_dir", "dataset_size", "git", "schema", "program_hash", "record", "trace_first_step",
            "checkpoints", "checkpoint_fingerprints", "data_state_fingerprints", "exported", "example_store",
            "state_names", "state_layout", "dataset_tokens", "example_tokens")


def check_extra(extra: dict | None, call: str) -> dict:
    """A loop's own run.json keys (JSON, none of REPLAY_KEYS), as a dict."""
    if extra is None:
        return {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise RecordError(f"{call}: give a dict of str keys")
    clash = sorted(set(extra) & set(REPLAY_KEYS))
    if clash:
        raise RecordError(f"{call}: {', '.join(clash)} {'is a key' if len(clash) == 1 else 'are keys'} replay writes "
                          "itself; name yours otherwise")
    try:
        return json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise RecordError(f"{call}: the values must be JSON (dicts, lists, numbers, strings): {e}") from None


def factory_spec(replayable: str) -> str:
    """A replay-protocol factory named as 'module:function' (replay/engine/protocol.py)."""
    module, sep, attr = str(replayable).partition(":")
    if not isinstance(replayable, str) or not sep or not module or not attr:
        raise RecordError(f"replay.init(replayable={replayable!r}): name the factory as 'module:function'")
    return replayable


def build(config: Any, entrypoint: str | Callable | None, dataset_size: int | None, checkpoint_dir: str,
          replayable: str | None = None, extra: dict | None = None) -> dict:
    """run.json at init. `entrypoint`: the @replay.entrypoint that rebuilds the loop (replayed by
    replay's own FACTORY); or `replayable`: the loop's own protocol factory (the trainer's)."""
    from replay.record.environment import environment

    extra = check_extra(extra, "replay.init(manifest=...)")

    try:
        config = json.loads(json.dumps(config))
    except (TypeError, ValueError) as e:
        raise RecordError(f"replay.init(config=...): the config must be JSON (dicts, lists, numbers, strings): {e}") from None
    tokens = dataset_size.count if isinstance(dataset_size, Tokens) else None
    dataset_size = None if tokens is not None else dataset_size
    if dataset_size is not None and (not isinstance(dataset_size, int) or isinstance(dataset_size, bool)
                                     or dataset_size <= 0):
        raise RecordError(f"replay.init(dataset_size={dataset_size!r}): the number of examples, an int > 0, or "
                          "replay.Tokens(T) for packed token rows")
    manifest = {**extra, "recorded_by": RECORDED_BY, "config": config, "environment": environment(),
                "argv": list(sys.argv), "checkpoint_dir": checkpoint_dir, "dataset_size": dataset_size,
                "checkpoints": [], **({"dataset_tokens": tokens} if tokens is not None else {})}
    folder = None
    if replayable is not None:
        manifest["replayable"] = factory_spec(replayable)
    else:
        spec, folder = entrypoint_spec(entrypoint)
        manifest.update(replayable=FACTORY, entrypoint=spec)
    if folder is not None:
        manifest["entrypoint_path"] = folder
    code = git_commit(Path(folder) if folder else Path.cwd())
    if code is not None:
        manifest["git"] = code
    return manifest
