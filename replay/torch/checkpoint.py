"""Checkpoints of a recorded torch run: the model and optimizer after k steps, as safetensors.

    run = replay.torch.init("runs/ref", config=cfg, model=model, optimizer=opt)
    replay.torch.checkpoint.save(run, model, opt)        # before step 0: checkpoint 0
    for k in range(steps):
        with run.step(rows) as rec: ...
        if (k + 1) % 10 == 0:
            replay.torch.checkpoint.save(run, model, opt)  # checkpoint k + 1
    ...
    replay.torch.checkpoint.load("runs/ref", 10, model, opt)   # resume, or evaluate, from step 10

A checkpoint named k holds the state after k steps (the input of step k), as the trainer's do:
RUN/checkpoints/k/model.safetensors (the module's state_dict under its own names: for
trainer.reference's OLMo the Hugging Face names, the format the published checkpoints use) and
optimizer.safetensors (every tensor of the optimizer's state_dict, its param_groups as JSON in
the file's metadata) and rng.safetensors (torch's generator states: CPU, each initialised CUDA
device), so a resumed run (`run.restore`) draws what the uninterrupted one drew. The folder is written under a temporary name and renamed when complete, so
a crash leaves no half checkpoint under a step's name. Safetensors has no checksum, so the xxh3
of each file is recorded in the run manifest ("checkpoint_files") and checked on every load: a
flipped bit is refused, never loaded.

Cost at a million steps: one folder per saved step (the manifest lists them); a save writes the
state once and holds one host copy of it while writing; a load reads one checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import xxhash

from replay.torch.errors import TorchRecordError
from traces import Run
from traces.run import read_manifest
from traces.storage.ondemand import fetch_checkpoint

FILES_KEY = "checkpoint_files"  # run manifest: {"<step>": {"model.safetensors": "<16 hex>", ...}}
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
_GROUPS = "param_groups"  # optimizer.safetensors metadata key: the param groups as JSON
_SCALARS = "scalars"  # ... and the state's non-tensor values (e.g. a float step count)


class TorchCheckpointError(TorchRecordError):
    """A torch checkpoint that is missing, damaged, or does not fit the model (exit 2)."""


def checkpoint_dir(run_path: str | os.PathLike) -> Path:
    return Path(run_path) / "checkpoints"


def steps(run_path: str | os.PathLike) -> list[int]:
    """The steps of the run's complete torch checkpoints (those its manifest records), ascending."""
    recorded = read_manifest(Path(run_path)).get(FILES_KEY) or {}
    return sorted(int(k) for k in recorded)


def latest(run_path: str | os.PathLike) -> int | None:
    """The newest checkpoint a resume can start from: the last one the trace reaches (a save
    flushes the trace first, so only a crash during the save itself leaves one beyond it)."""
    end = Run.open(run_path).trace.end
    usable = [k for k in steps(run_path) if k <= end]
    return usable[-1] if usable else None


def _digest(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _host(t: torch.Tensor) -> torch.Tensor:
    # A copy: tied weights share storage, which safetensors refuses, and the save must not see
    # a later in-place update.
    return t.detach().to("cpu", copy=True).contiguous()


def save(run: Any, model: torch.nn.Module, optimizer: Any = None) -> Path:
    """Saves `model` (and `optimizer`) as checkpoint `run.next_step` of the recording torch run
    `run` (replay.torch.init's), after writing the trace up to it. Returns the folder."""
    from safetensors.torch import save_file

    if run.finished:
        raise TorchCheckpointError(f"{run.path}: the run is finished; save checkpoints before run.finish()")
    if run._in_step:
        raise TorchCheckpointError("replay.torch.checkpoint.save inside a recorded step; save after the with block")
    step = run.next_step
    run.flush()  # the trace reaches at least as far as the newest checkpoint
    root = checkpoint_dir(run.path)
    final, tmp = root / str(step), root / f".{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: _host(v) for k, v in model.state_dict().items()}, str(tmp / MODEL_FILE), metadata={"step": str(step)})
    files = [MODEL_FILE]
    if optimizer is not None:
        tensors, scalars, sd = {}, {}, optimizer.state_dict()
        for idx, state in sd["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state.{idx}.{key}"] = _host(value)
                else:
                    scalars[f"{idx}.{key}"] = value
        save_file(tensors, str(tmp / OPTIMIZER_FILE), metadata={_GROUPS: json.dumps(sd["param_groups"]),
                                                               _SCALARS: json.dumps(scalars), "step": str(step)})
        files.append(OPTIMIZER_FILE)
    save_file(_rng_states(), str(tmp / RNG_FILE), metadata={"step": str(step)})
    files.append(RNG_FILE)
    digests = {name: _digest(tmp / name) for name in files}
    if final.exists():  # a re-save of the same step (a resumed run): the newer state replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    recorded = dict(run._run.manifest.get(FILES_KEY) or {})
    recorded[str(step)] = digests
    run._run.update_manifest(**{FILES_KEY: recorded, "checkpoints": sorted(int(k) for k in recorded)})
    return final


def _verified(run_path: Path, step: int, name: str) -> Path:
    recorded = (read_manifest(run_path).get(FILES_KEY) or {}).get(str(step))
    if recorded is None:
        have = steps(run_path)
        raise TorchCheckpointError(f"{run_path}: no torch checkpoint {step} (it has {', '.join(map(str, have)) or 'none'})"
                                   "; use one of those steps")
    path = checkpoint_dir(run_path) / str(step) / name
    fetch_checkpoint(path.parent)  # a remote run's local copy fetches the step's files first (traces/storage/ondemand.py)
    if name not in recorded:
        raise TorchCheckpointError(f"{path}: checkpoint {step} was saved without {name}; load it without that part")
    if not path.is_file():
        raise TorchCheckpointError(f"{path}: missing, though the manifest records it; the checkpoint is damaged: "
                                   "use another step")
    if _digest(path) != recorded[name]:
        raise TorchCheckpointError(f"{path}: its bytes differ from those saved (xxh3 mismatch); the checkpoint is "
                                   "damaged: use another step")
    return path


def read_model(run_path: str | os.PathLike, step: int) -> dict[str, torch.Tensor]:
    """Checkpoint `step`'s model tensors by state_dict name (checked against the manifest)."""
    from safetensors.torch import load_file

    return load_file(str(_verified(Path(run_path), step, MODEL_FILE)))


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def _restore_rng(run_path: Path, step: int) -> None:
    """torch's generator states as checkpoint `step` saved them; nothing for a checkpoint saved
    before they were (a resumed run's records then show whether its RNG stream matches)."""
    from safetensors.torch import load_file

    if RNG_FILE not in ((_manifest_files(run_path).get(str(step))) or {}):
        return
    states = load_file(str(_verified(run_path, step, RNG_FILE)))
    torch.set_rng_state(states["cpu"])
    cuda = [states[f"cuda.{i}"] for i in range(len(states) - 1) if f"cuda.{i}" in states]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _manifest_files(run_path: Path) -> dict:
    return read_manifest(run_path).get(FILES_KEY) or {}


def load(run_path: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: Any = None,
         restore_rng: bool = False) -> None:
    """Loads checkpoint `step` into `model` (and `optimizer`), bit for bit; `restore_rng`: torch's
    generator states too (a resume; an evaluation leaves them alone)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = read_model(run_path, step)
    missing, unexpected = set(model.state_dict()) - set(tensors), set(tensors) - set(model.state_dict())
    if missing or unexpected:
        raise TorchCheckpointError(f"{run_path}: checkpoint {step} does not fit the model: missing "
                                   f"{', '.join(sorted(missing)[:3]) or 'none'}, unknown "
                                   f"{', '.join(sorted(unexpected)[:3]) or 'none'}; load it into the model it was saved from")
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise TorchCheckpointError(f"{run_path}: checkpoint {step} does not fit the model: "
                                   f"{str(e).splitlines()[-1].strip()}") from None
    if restore_rng:
        _restore_rng(Path(run_path), step)
    if optimizer is None:
        return
    path = _verified(Path(run_path), step, OPTIMIZER_FILE)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    state: dict[int, dict] = {}
    for key, value in load_file(str(path)).items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for key, value in json.loads(meta[_SCALARS]).items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    try:
        optimizer.load_state_dict({"state": state, _GROUPS: json.loads(meta[_GROUPS])})
    except (ValueError, KeyError) as e:
        raise TorchCheckpointError(f"{run_path}: checkpoint {step}'s optimizer state does not fit the optimizer: "
                                   f"{e}") from None
