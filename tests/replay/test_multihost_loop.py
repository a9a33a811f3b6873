"""A user loop recorded through `replay.init` on two processes (jax.distributed on 127.0.0.1, two
CPU devices each; tests/replay/multihost/mh_loop.py): process 0 writes the run, each process
hashes only its rows and the global order is gathered on device, every process saves its shards.

What holds today, and is checked: the run completes with every step's per-example hashes equal to
those of the global batch, in global order; a second two-process recording is bit-identical to it,
one with another learning rate is not. Not yet: replaying it in one process (four devices) runs,
with the saved state placed on the same mesh there (replay/record/saved_layout.py), but the
cross-process gradient reduction rounds differently from the in-process one, so those bits are
"measured only" (the contract names process_count); replay and bisect with two processes are not
built. Issue 32 stays open for them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replay.record.hashing import example_hashes
from traces import Run, compare

HERE = Path(__file__).resolve().parent / "multihost"
sys.path.insert(0, str(HERE))
import mh_loop  # noqa: E402

pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "REPLAY_DEBUG")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    return env


def record(path: Path, processes: int, lr: float) -> Run:
    port = str(_port())
    args = lambda pid: [sys.executable, str(HERE / "mh_loop.py"), str(path), str(processes), str(pid), port, str(lr)]  # noqa: E731
    procs = [subprocess.Popen(args(pid), cwd=HERE, env=_env(4 // processes), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in range(processes)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    return Run.open(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    return {"two": record(root / "two", 2, 0.1), "again": record(root / "again", 2, 0.1),
            "lr": record(root / "lr", 2, 0.2)}


def test_two_processes_record_one_run_with_the_global_batches_hashes(runs):
    run = runs["two"]
    assert run.status == "complete" and run.trace.end == mh_loop.STEPS
    assert run.manifest["environment"]["process_count"] == 2 and run.manifest["checkpoints"] == [0, 3, 6]
    for k in range(mh_loop.STEPS):
        assert np.array_equal(run.trace.read(k).example_hashes, example_hashes(mh_loop.batch_at(k))), k


def test_a_second_two_process_recording_is_bit_identical_and_another_learning_rate_is_not(runs):
    assert compare(runs["two"].trace, runs["again"].trace).identical
    c = compare(runs["two"].trace, runs["lr"].trace)
    assert c.first_step == 0 and "update/w" in {d.name for d in c.diffs}, c.diffs
