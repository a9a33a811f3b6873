"""The real host-count bug, end to end: a run resumed on twice the hosts (trainer/order.py).

A `tiny` run (one block, trace.level=step) trains 2K steps in one process: the clean run. Two copies of it,
one per sampler, stop at step K and are resumed on 2 processes (jax.distributed on 127.0.0.1, one
CPU device each; the one-process runs have 2 virtual devices, so only the host count changes).
With `data.sampler=contiguous-per-host` host 0 jumps to position K * B/2 of its slice: `replay
audit` flags B's trace alone (half of every batch from step K on came back early) and `replay
bisect` against the clean run names step K, cause `data`, 8 of 16 examples already seen. With
the default sampler the resumed run is the clean run, bit for bit: every record and the final
state's fingerprint (which covers every parameter and optimizer leaf).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replay.audit import audit
from replay.bisect import bisect
from tests.ports import free_port
from traces import Run

ROOT = Path(__file__).resolve().parents[2]
K = 4  # the resume step
B = 16  # tiny's global batch
SAMPLERS = ("contiguous-per-host", "global")

_ONE_PROCESS = r"""
import sys
from trainer.config import apply_overrides
from trainer.presets import get_preset
from trainer.loop import train
root, k = sys.argv[1], int(sys.argv[2])
# One block: every claim here is about the data order, and a block is most of each process's compile.
base = apply_overrides(get_preset("tiny"), [f"steps={2 * k}", f"checkpoint.every_steps={k}", "trace.level=step",
                                          "model.n_layers=1"])
train(base, f"{root}/clean", preset="tiny")
for sampler in ("contiguous-per-host", "global"):
    train(apply_overrides(base, [f"steps={k}", f"data.sampler={sampler}"]), f"{root}/{sampler}", preset="tiny")
"""

_TWO_PROCESSES = r"""
import sys
from pathlib import Path
import jax
pid, port, root, k = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
assert jax.process_count() == 2 and jax.device_count() == 2
from trainer.loop import load_resume_config, train
for sampler in ("contiguous-per-host", "global"):
    path = Path(f"{root}/{sampler}")
    train(load_resume_config(path, None, 2 * k), path, resume=True)
"""


def _env(devices: int) -> dict:
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sampler-resume")
    one = subprocess.run([sys.executable, "-c", _ONE_PROCESS, str(root), str(K)], env=_env(2), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESSES, str(i), port, str(root), str(K)], env=_env(1),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        try:
            _, err = p.communicate(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, err[-3000:]
    return root


def _open(root: Path, name: str) -> Run:
    return Run.open(root / name)


@pytest.mark.slow
def test_the_manifest_records_the_sampler_and_the_host_count_of_each_resume(runs):
    for sampler in SAMPLERS:
        run = _open(runs, sampler)
        assert run.status == "complete" and run.trace.end == 2 * K
        assert run.manifest["config"]["data"]["sampler"] == sampler
        assert run.manifest["environment"]["process_count"] == 1
        assert run.manifest["resumes"] == [{"step": K, "process_count": 2, "device_count": 2}]


@pytest.mark.slow
def test_audit_flags_half_of_every_batch_after_a_contiguous_per_host_resume_from_the_trace_alone(runs):
    report = audit(_open(runs, "contiguous-per-host"), source=False)
    assert not report.ok and report.first_early_repeat_step == K
    early = report.early_repeats()
    assert [r.step for r in early] == list(range(K, 2 * K))  # every batch after the resume
    for r in early:
        assert r.positions == tuple(range(B // 2)), r  # host 0's half: 50% of the batch
        assert {s for s, _ in r.first_seen} <= set(range(K // 2, K))  # fed by the one host before K
    assert audit(_open(runs, "clean"), source=False).ok and audit(_open(runs, "global"), source=False).ok


@pytest.mark.slow
def test_bisect_names_the_resume_step_the_cause_and_the_share_already_seen(runs):
    report = bisect(_open(runs, "clean"), _open(runs, "contiguous-per-host"), refine=False)
    assert report.first_step == K and report.cause == "data"
    repeated = report.repeated("B")
    assert len(repeated) / B == 0.5 and sorted(e.position for e in repeated) == list(range(B // 2))
    assert all(s["step"] < K for e in repeated for s in e.seen if s["run"] == "B")


@pytest.mark.slow
def test_with_the_default_sampler_the_resumed_run_is_the_uninterrupted_run(runs):
    clean, resumed = _open(runs, "clean"), _open(runs, "global")
    report = bisect(clean, resumed, refine=False)
    assert report.comparison.identical and report.whole and report.first_step is None
    assert report.comparison.compared == (0, 2 * K)
    for step in range(2 * K):
        a, b = clean.trace.read(step), resumed.trace.read(step)
        assert a.batch_hash == b.batch_hash and np.array_equal(a.example_hashes, b.example_hashes), step
        assert a.metrics.tobytes() == b.metrics.tobytes() and a.rng.tobytes() == b.rng.tobytes(), step
    fingerprints = [r.manifest["checkpoint_fingerprints"][str(2 * K)] for r in (clean, resumed)]
    assert fingerprints[0] == fingerprints[1]  # the state after the last step, all of it
    # The same comparisons tell the buggy sampler's resume from the clean run.
    buggy = _open(runs, "contiguous-per-host")
    assert not bisect(clean, buggy, refine=False).comparison.identical
    assert buggy.manifest["checkpoint_fingerprints"][str(2 * K)] != fingerprints[0]
