"""Torch-reference vs JAX-trainer pairs for tests: same weights, same batches, AdamW both sides.

`clean_config` / `train_jax` / `train_torch`: a pair a module trains for itself.

`demo()` / `port_run(bug)`: the pair several files read, made once per test session. The files
of the cross-framework checks (tests/replay/test_demo_reference.py, tests/torch/test_port_bugs.py,
tests/torch/test_compare_eval.py, tests/replay/test_bisect_cross.py, tests/torch/test_jax_sketches.py)
all need a reference, the
clean JAX port and JAX ports with one bug each, from the same weights on the same data; each
used to train its own (about 10 CPU seconds a run, compiles mostly). Here they are the runs of
`replay demo --reference torch --steps 8` (the reference, the clean port, the RoPE-bug port: the
CLI's own config, trainer.demo_reference.demo_config, whose JAX runs record distance sketches, so
bisect reads both traces) and, for the other bugs, that config with the bug switched on
(trainer/port_bugs.py); with `sketches=False` the same JAX runs without sketches, the trainer's
default, which bisect replays. The folder is the session's (tests/conftest.py,
REPLAY_TESTS_SHARED_DIR); xdist workers make each run under a file lock, the first one to need
it, and the others wait for it. Readers must not write into these runs (copy them first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from trainer.config import Config
from trainer.presets import get_preset

DEMO_STEPS = 8  # the reference demo's least --steps; checkpoints every 2 (its quarters)
_fallback_dir: str | None = None


def clean_config(steps: int = 20, every: int = 5, z_loss: float = 0.0, level: str = "layer") -> Config:
    base = get_preset("tiny")
    return dataclasses.replace(
        base, steps=steps, trace=dataclasses.replace(base.trace, level=level), model=dataclasses.replace(base.model, dropout=0.0),
        optimizer=dataclasses.replace(base.optimizer, decay_steps=max(steps, 10), warmup_steps=min(5, steps),
                                      z_loss=z_loss),
        checkpoint=dataclasses.replace(base.checkpoint, every_steps=every, keep=0))


def train_jax(cfg: Config, path: Path) -> Path:
    from trainer.loop import train

    train(cfg, path)
    return path


def train_torch(cfg: Config, path: Path) -> Path:
    """The reference from the trainer's initial params, on the trainer's batches, checkpointed
    where the trainer checkpoints (trainer/reference_train.py)."""
    from trainer.reference_train import train_reference

    return train_reference(cfg, path, cfg.steps)


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread inside the block (the demo's own choice, trainer/demo_reference.py): the
    tiny reference's ops gain nothing from a second thread, and on the suite's busy 2 cores torch's
    threads spin-wait for each other. A 2-step held-out variant run (tests/torch/test_port_ops.py)
    took 2.3-3.4 CPU s on torch's default 2 threads at load ~9, 0.2 s on one (2026-12-05). No
    claim of these tests is about bits that a thread count could change: distances are judged
    against the noise floor."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ made once per test session

def _shared_dir() -> Path:
    global _fallback_dir
    root = os.environ.get("REPLAY_TESTS_SHARED_DIR")
    if not root:  # imported outside a pytest session with tests/conftest.py: this process's own
        _fallback_dir = _fallback_dir or tempfile.mkdtemp(prefix="replay-shared-runs-")
        root = _fallback_dir
    return Path(root)


def shared(name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name` of the session's shared runs, made by `make(folder)` the first time any
    process asks for it. A make that raised leaves no marker: the next caller makes it again."""
    root = _shared_dir()
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if make raises
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            make(out)
            done.touch()
    return out


def demo_config() -> Config:
    from trainer.demo_reference import demo_config as cli_config

    return cli_config(DEMO_STEPS)


def demo() -> dict:
    """`replay demo --reference torch --steps 8 --json`, run once: {"exit_code", "output",
    "stdout"} of the CLI and the paths of its three runs ("reference", "jax", "rope")."""

    def make(out: Path) -> None:
        from tests.cli_util import invoke

        out.mkdir()
        r = invoke("demo", "--reference", "torch", "--steps", str(DEMO_STEPS), "--out", str(out / "demo"), "--json")
        (out / "cli.json").write_text(json.dumps({"exit_code": r.exit_code, "output": r.output, "stdout": r.stdout}))

    out = shared("reference-demo", make)
    from trainer.demo_reference import RUNS

    return {**json.loads((out / "cli.json").read_text()),
            **dict(zip(("reference", "jax", "rope"), (out / "demo" / name for name in RUNS)))}


def port_run(bug: str | None, sketches: bool = True) -> Path:
    """The JAX trainer on the demo's config (the demo's reference is its pair) with port bug `bug`
    on (None: the clean port); `sketches=False`: recorded without distance sketches."""
    from trainer.port_bugs import with_bug

    cfg = demo_config()
    assert cfg.trace.sketches, "the demo's JAX runs record sketches: port_run(..., sketches=True) are its runs"
    if sketches and bug in (None, "rope"):  # the demo trained them
        return demo()["jax" if bug is None else "rope"]
    if not sketches:
        cfg = dataclasses.replace(cfg, trace=dataclasses.replace(cfg.trace, sketches=False))
    name = f"port-{bug or 'clean'}" + ("" if sketches else "-no-sketches")
    return shared(name, lambda out: train_jax(cfg if bug is None else with_bug(cfg, bug), out))
