"""The loop protocol's core (replay/engine/protocol.py): replay's engine, verify and noise floor ask a run's
replayable for what they need, never the trainer, so they work for any loop that provides it.

Each test uses a replayable written here (numpy and a few tiny jnp ops, nothing compiled of any
size) and runs written with the traces API alone. Before issue 31 these paths read the trainer's
`built` (initial state, verify's mesh and step program), its config (bisect's replica layers), its
TrainState (the noise floor's nudge) and its error classes (the exit-code table).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import traces
from replay.record.hashing import batch_hash
from replay import errors
from replay.engine.replayer import Replayer, ReplayUnavailable, open_replayable
from replay.verify import VerifyInputError, verify
from replay.verify.classify import owner
from replay.verify.names import replica_layers, replica_name

ROOT = Path(__file__).resolve().parents[2]
M, N, STEPS = 8, 4, 4
LAYERS = ["enc", "dec"]  # not the trainer's layer names: read from the recorded names, not a config


def _write(path: Path, manifest: dict, tensors=(), fingerprints=None, loss=1.0) -> traces.Run:
    schema = traces.Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),), tensors=tuple(tensors))
    r = traces.Run.create(path, schema, manifest)
    w = r.writer(8)
    for k in range(STEPS):
        fps = None if fingerprints is None else np.asarray(fingerprints(k), np.uint64)
        hashes = np.arange(2 * k, 2 * k + 2, dtype=np.uint64)
        w.append(traces.StepRecord(k, np.array([k, 1], np.uint32), batch_hash(hashes), hashes,
                                   np.array([loss], np.float32), fingerprints=fps,
                                   rms=None if fps is None else np.ones(len(fps), np.float32)))
    r.finish()
    return traces.Run.open(path)


class Loop:
    """The required methods only: a loop that offers no capability."""

    def __init__(self, checkpoints=(0,)):
        self.checkpoints = list(checkpoints)
        self.schema = traces.Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),))  # _write's

    def environment(self) -> dict:
        return {}

    def program_hash(self):
        return None

    def checkpoint_steps(self) -> list[int]:
        return self.checkpoints

    def restore(self, step: int):
        return {"w": jnp.ones(4, jnp.float32), "at": step}

    def step(self, state, step: int):
        metrics = {"loss": jnp.sum(state["w"]) / 4, "rng": np.array([step, 1], np.uint32)}  # what _write recorded
        return state, metrics, np.arange(2 * step, 2 * step + 2, dtype=np.uint64)


class Replicas(Loop):
    """A mesh-invariant loop of N devices and M microbatches whose device `bad` computes wrongly."""

    def __init__(self, bad: int | None, layout=(N, M)):
        super().__init__()
        self.bad, self.layout = bad, layout

    def replica_layout(self):
        return self.layout

    def layer_groups(self):
        return list(LAYERS)

    def replica_fingerprints(self, state, step, rotate):
        out = np.full((M, len(LAYERS)), 100 + step, np.uint64)
        for i in range(M):
            if (owner(i, N, M) - rotate) % N == self.bad:  # the device that computes microbatch i here
                out[i, 1] ^= np.uint64(1)
        return out


MESH_INVARIANT = {"config": {"mesh": {"mesh_invariant": True, "n_microbatches": M}}, "mesh": {"devices": N}, "data": {}}


# ------------------------------------------------------------------------------ verify


def test_verify_re_executes_through_the_replayables_capabilities_and_names_the_chip(tmp_path):
    run = _write(tmp_path / "run", MESH_INVARIANT)
    report = verify(run, Replicas(bad=2), 1, 2, rotate=1)
    assert report.devices == N and report.microbatches == M and report.steps_verified == 2
    assert [(f.kind, f.device, f.steps, f.layers) for f in report.findings] == [("persistent", 2, [1, 2], ["dec"])]
    assert verify(run, Replicas(bad=None), 1, 2).clean


def test_verify_refuses_a_replayable_without_the_capability_in_one_line(tmp_path):
    run = _write(tmp_path / "run", MESH_INVARIANT)
    """Neither method is available: no replicas computed apart and no rotated_step (the general
    method, replay/verify/rotation.py); or replicas laid out without the fingerprints to compare."""
    with pytest.raises(VerifyInputError, match=r"provides no rotated_step\(state, step, rotate\)"):
        verify(run, Loop(), 1, 2)
    with pytest.raises(VerifyInputError, match=r"provides no rotated_step\(state, step, rotate\)"):
        verify(run, Replicas(bad=None, layout=None), 1, 2)  # not mesh-invariant as replayed, no general method

    class LayoutOnly(Loop):
        def replica_layout(self):
            return (N, M)

    with pytest.raises(VerifyInputError, match=r"computes replicas apart \(replica_layout\) but provides no "
                                                r"replica_fingerprints\(state, step, rotate\)"):
        verify(run, LayoutOnly(), 1, 2)


# ------------------------------------------------------------------------------ bisect's hardware verdict


def test_bisect_reads_the_replica_layers_from_the_recorded_names(tmp_path):
    from replay.bisect.replica import hardware_fault

    names = [replica_name(i, g, M) for i in range(M) for g in LAYERS]
    bad = {i for i in range(M) if owner(i, N, M) == 1}

    def fps(bad_mbs):
        return lambda k: [7 + (k >= 2 and int(name.split("/")[1][2:]) in bad_mbs) for name in names]

    a = _write(tmp_path / "a", MESH_INVARIANT, [(n, "backward") for n in names], fps(bad))
    b = _write(tmp_path / "b", MESH_INVARIANT, [(n, "backward") for n in names], fps(set()))
    found = hardware_fault(a, b, 2)
    assert found is not None and found["device"] == 1 and found["microbatches"] == sorted(bad)
    assert found["layers"] == LAYERS == replica_layers(a.schema.tensor_names, M)


def test_the_trainers_recorded_replica_names_decode_to_its_layers():
    from trainer import sdc
    from trainer.config import apply_overrides
    from trainer.presets import get_preset

    cfg = apply_overrides(get_preset("tiny"), ["mesh.mesh_invariant=true", f"mesh.n_microbatches={M}",
                                               "check.replicas=true"])
    names = [n for n, _ in sdc.extra_tensors(cfg, "layer")]
    assert replica_layers(names, M) == [g for g, _ in sdc.layer_groups(cfg)]


# ------------------------------------------------------------------------------ the engine


def test_replayer_starts_at_step_0_from_the_loops_initial_state(tmp_path):
    run = _write(tmp_path / "run", {"config": {}, "data": {}})

    class WithInit(Loop):
        def initial_state(self):
            return "entering step 0"

    r = Replayer("A", run)
    r._rep = WithInit(checkpoints=[2])
    assert r.checkpoints() == [0, 2] and r.restore(0) == "entering step 0"
    r = Replayer("A", run)
    r._rep = Loop(checkpoints=[2])  # no initial_state: only saved checkpoints
    assert r.checkpoints() == [2]
    with pytest.raises(ReplayUnavailable, match="has no checkpoint 0"):
        r.restore(0)


def test_a_loops_own_input_error_is_bad_input_and_cannot_be_replayed_here(tmp_path, monkeypatch):
    class BadSource(ValueError, errors.InputError):
        pass

    assert errors.exit_code_of(BadSource("x")) == errors.EXIT_BAD_INPUT
    run = _write(tmp_path / "run", {"config": {}, "data": {}})

    def load(run, **options):
        raise BadSource("the data file is gone")

    monkeypatch.setattr("replay.engine.protocol.load", load)
    with pytest.raises(ReplayUnavailable, match=r"cannot be replayed here \(BadSource: the data file is gone\)"):
        open_replayable(run)


def test_the_exit_table_names_no_trainer_class_and_the_trainers_errors_are_input_errors():
    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.faults import FaultError
    from trainer.mesh import MeshError

    assert not [name for name in errors.EXIT_CODES if name.startswith("trainer.")]
    for cls in (ConfigError, DataError, MeshError, FaultError):
        assert issubclass(cls, errors.InputError) and issubclass(cls, ValueError), cls
        assert errors.exit_code_of(cls("x")) == errors.EXIT_BAD_INPUT


# ------------------------------------------------------------------------------ the noise floor


def test_the_noise_floor_nudges_a_state_that_names_no_parameters(tmp_path):
    from replay.engine.noise import floor_by_replay

    run = _write(tmp_path / "run", {"config": {}, "data": {}}, loss=1.0)  # Loop's loss: mean of ones
    floors, replays = floor_by_replay(run, 0, 3, replayable=Loop())
    assert replays == 1 and sorted(floors) == [0, 1, 2]
    assert all(0 < f[0] < 1e-6 for f in floors.values())  # one ULP up of every weight, measured


# ------------------------------------------------------------------------------ the layers


CORE = ("replay/engine/protocol.py", "replay/engine/replayer.py", "replay/engine/engine.py", "replay/cli/replaying.py",
        "replay/bundle/finding.py", "replay/engine/noise.py", "replay/verify/", "replay/bisect/replica.py", "replay/errors.py")


def test_the_protocol_core_imports_nothing_from_trainer():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_layers.py"), str(ROOT)], capture_output=True,
                          text=True, timeout=60)
    assert not [line for line in done.stdout.splitlines() if line.startswith(CORE)], done.stdout
