"""Checkpoint integrity: a fingerprint of the full state recorded at every save and verified after
every restore (TrainerReplay.restore, `replay train --resume`); damaged checkpoint files are one
line naming the checkpoint; a full disk while saving is one line and the run stays resumable.

One tiny run is read by the module (the session's, tests/tiny_run.py); each test damages its own copy."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.cli_util import assert_one_line_error, dir_digest, invoke
from tests.tiny_run import tiny_run
from tests.trainer.full_disk import full_after_checkpoint_0
from traces import Run
from traces.run import write_manifest
from trainer import mesh as M
from replay.record.orbax_io import CheckpointDamagedError
from replay.record.checkpointer import Checkpointer
from trainer.config import from_dict
from trainer.presets import get_preset
from replay.record.fingerprint import state_fingerprint

CFG = get_preset("tiny")  # 20 steps, checkpoints 0, 10, 20


@pytest.fixture(scope="module")
def trained() -> Path:
    """The session's tiny run (tests/tiny_run.py: CFG, trained once for this file and others): read only."""
    path = tiny_run()
    assert from_dict(Run.open(path).manifest["config"]) == CFG
    return path


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A copy of the run as if this process had trained it (as this module once did): a writer puts
    its pid into RUN/.lock, and the shared run's holds its maker's, often another process's."""
    shutil.copytree(trained, tmp_path / "run")
    (tmp_path / "run" / ".lock").write_text(f"pid {os.getpid()}")
    return tmp_path / "run"


def data_file(run: Path, step: int) -> Path:
    """The largest chunk file of checkpoint `step`: where the parameters' bytes are."""
    files = [p for p in (run / "checkpoints" / str(step)).rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def flip_bit(path: Path, offset: int | None = None, bit: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def restore(run: Path, step: int, fingerprint: str | None):
    with Checkpointer(run / "checkpoints", create=False) as ck:
        return ck.restore(step, M.sharded_abstract_state(CFG, M.make_mesh(CFG.mesh)), fingerprint=fingerprint)


def leaves_bytes(state) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(state)]


def error_line(result) -> str:
    """The one `error:` line of a command that failed while training: besides it, stderr holds only
    the command's own status line and progress bar (no traceback, no orbax or absl output)."""
    lines = result.stderr.strip().splitlines()
    ours = [ln for ln in lines if not ln.startswith(("compiling the train step for ", "train run "))]
    assert len(ours) == 1 and ours[0].startswith("error: ") and ours[0] == lines[-1], result.stderr
    return ours[0]


def fingerprints(run: Path) -> dict[str, str]:
    return Run.open(run).manifest["checkpoint_fingerprints"]


# ------------------------------------------------------------------------ the fingerprint

def test_every_checkpoint_records_the_fingerprint_of_its_full_state(trained):
    recorded = fingerprints(trained)
    assert sorted(recorded, key=int) == ["0", "10", "20"] == [str(k) for k in Run.open(trained).manifest["checkpoints"]]
    assert all(len(v) == 16 and int(v, 16) >= 0 for v in recorded.values())
    assert len(set(recorded.values())) == 3
    for step, value in recorded.items():  # what was recorded is what is on disk
        assert state_fingerprint(restore(trained, int(step), None)) == value


def test_the_fingerprint_covers_every_leaf_its_path_and_typed_keys(trained):
    state = restore(trained, 10, None)
    base = state_fingerprint(state)
    flat, tree = jax.tree_util.tree_flatten(state)
    picked = sorted({0, 1, len(flat) // 2, len(flat) - 2, len(flat) - 1})  # step, params, opt_state, key
    changed = []
    for i in picked:  # one bit of one element of a leaf; same sharding, so one compiled program
        a = np.asarray(flat[i]).copy()
        a.reshape(-1).view(np.uint8)[0] ^= 1
        leaf = jax.device_put(a, flat[i].sharding)
        changed.append(state_fingerprint(jax.tree_util.tree_unflatten(tree, [*flat[:i], leaf, *flat[i + 1:]])))
    assert base not in changed and len(set(changed)) == len(picked)
    w = jnp.ones((4, 4), jnp.float32)
    assert state_fingerprint({"a": w, "b": w * 2}) != state_fingerprint({"a": w * 2, "b": w})  # paths count
    typed = {"key": jax.random.key(0), "w": w}
    assert state_fingerprint(typed) != state_fingerprint({"key": jax.random.key(1), "w": w})
    assert state_fingerprint(typed) == state_fingerprint({"key": jax.random.key(0), "w": w})


# ------------------------------------------------------------------------ damaged checkpoint files

def test_a_flipped_bit_restores_silently_unless_the_fingerprint_is_checked(run_copy, trained):
    flip_bit(data_file(run_copy, 10))
    # Orbax itself takes it: zstd chunks carry no checksum, so only the fingerprint can tell.
    silent = restore(run_copy, 10, None)
    assert leaves_bytes(silent) != leaves_bytes(restore(trained, 10, None))
    recorded = fingerprints(run_copy)["10"]
    with pytest.raises(CheckpointDamagedError) as e:
        restore(run_copy, 10, recorded)
    assert str(e.value) == (
        f"{run_copy.absolute()}/checkpoints/10: checkpoint 10 is damaged (its state's fingerprint "
        f"{state_fingerprint(silent)} differs from {recorded} recorded when it was saved); restore from "
        "another checkpoint or re-create the run")


@pytest.mark.parametrize("damage", ["truncate", "zero", "delete"])
def test_unreadable_checkpoint_files_are_one_short_line(run_copy, damage, capfd):
    target = data_file(run_copy, 10)
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 3])
    elif damage == "zero":
        target.write_bytes(bytes(target.stat().st_size))
    else:
        target.unlink()
    with pytest.raises(CheckpointDamagedError) as e:
        restore(run_copy, 10, fingerprints(run_copy)["10"])
    msg = str(e.value)
    assert msg.startswith(f"{run_copy.absolute()}/checkpoints/10: checkpoint 10 is damaged (cannot read ")
    assert "\n" not in msg and len(msg) < 400 and "tensorstore_spec" not in msg, msg
    assert capfd.readouterr().err == ""  # orbax's thread tracebacks and absl logs stay off the terminal


def test_trainer_replay_verifies_and_notes_an_unverified_checkpoint(run_copy):
    from trainer.replayable import TrainerReplay

    flip_bit(data_file(run_copy, 10))
    manifest = Run.open(run_copy).manifest
    del manifest["checkpoint_fingerprints"]["20"]  # as a run from before fingerprints were recorded
    write_manifest(run_copy / "run.json", manifest)
    rep = TrainerReplay(Run.open(run_copy))
    with pytest.raises(CheckpointDamagedError, match=r"checkpoints/10: checkpoint 10 is damaged \(its state's fingerprint"):
        rep.restore(10)
    assert rep.unverified == [] and int(rep.restore(0).step) == 0
    assert int(rep.restore(20).step) == 20 and rep.unverified == [20]
    assert len(rep.restore_notes) == 1 and "checkpoint 20 has no recorded fingerprint" in rep.restore_notes[0]


# ------------------------------------------------------------------------ replay train --resume

def test_resume_from_a_newest_checkpoint_with_one_flipped_bit_refuses_naming_it(run_copy):
    flip_bit(data_file(run_copy, 20))
    before = dir_digest(run_copy)
    result = invoke("train", "--resume", str(run_copy), "--steps", "21")  # a complete run: continued by a step
    assert_one_line_error(result, "checkpoints/20: checkpoint 20 is damaged", "fingerprint", "re-create the run")
    assert dir_digest(run_copy) == before  # refused before the run was touched
    assert Run.open(run_copy).status == "complete"


def test_resume_from_an_unverified_checkpoint_says_so(run_copy):
    manifest = Run.open(run_copy).manifest
    manifest.pop("checkpoint_fingerprints")
    write_manifest(run_copy / "run.json", manifest)
    result = invoke("train", "--resume", str(run_copy), "--steps", "21", "--json")
    assert result.exit_code == 0, result.output
    assert "checkpoint 20 has no recorded fingerprint" in result.stderr and "unverified" in result.stderr


def test_a_resume_that_does_not_reproduce_a_recorded_step_exits_1(run_copy, monkeypatch):
    import replay.record.recorder as recorder

    shutil.rmtree(run_copy / "checkpoints" / "20")  # resume from 10: steps 10..19 are re-recorded
    real = recorder.to_record

    def drifted(schema, step, metrics, example_hashes):
        rec = real(schema, step, metrics, example_hashes)
        changed = rec.metrics.copy()  # the record's values are views of the step's one read-only output vector
        changed.view(np.uint32)[0] ^= 1  # the loss's last bit: what a nondeterministic step would do
        return dataclasses.replace(rec, metrics=changed)

    monkeypatch.setattr(recorder, "to_record", drifted)
    result = invoke("train", "--resume", str(run_copy), "--steps", "21")
    assert result.exit_code == 1, result.output
    assert "step 10 is already recorded with different content" in error_line(result)


# ------------------------------------------------------------------------ a full disk while saving

def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_the_run_resumes(tmp_path, monkeypatch):
    path = tmp_path / "run"
    full_after_checkpoint_0(monkeypatch, path)  # checkpoint 2's arrays meet a full disk
    result = invoke("train", "--out", str(path), "--steps", "4", "--set", "checkpoint.every_steps=2")
    assert result.exit_code == 2, result.output
    line = error_line(result)
    # Checkpoint 2 is written while steps 2 and 3 run; its failure surfaces at the save of 4.
    for needle in ("no space left", "saving checkpoint 2", "every step up to 3 is recorded", f"--resume {path}"):
        assert needle in line, line
    run = Run.open(path)
    assert run.status == "crashed" and run.trace.end == 4 and run.manifest["checkpoints"] == [0]

    monkeypatch.undo()  # space freed
    result = invoke("train", "--resume", str(path), "--json")
    assert result.exit_code == 0, result.output
    run = Run.open(path)
    assert run.status == "complete" and run.trace.end == 4 and run.manifest["checkpoints"] == [0, 2, 4]
    assert sorted(run.manifest["checkpoint_fingerprints"], key=int) == ["0", "2", "4"]
    assert json.loads(result.stdout.strip().splitlines()[-1])["started_at"] == 0
