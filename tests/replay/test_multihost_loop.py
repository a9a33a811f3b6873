"""A user loop recorded through `replay.init` on two processes (jax.distributed on 127.0.0.1, two
CPU devices each; tests/replay/multihost/mh_loop.py): process 0 writes the run, each process
hashes only its rows and the global order is gathered on device, every process saves its shards.

What holds, and is checked: the run completes with every step's per-example hashes equal to those
of the global batch, in global order; a second two-process recording is bit-identical to it, one
with another learning rate is not. `replay run --coordinator --num-processes 2 --process-id I`,
started once per process, replays it bit-exact with the loop's code (each process restores its
shards and feeds its rows; process 0 alone prints; both exit alike). Replayed in one process (four
devices) it runs "measured only", the contract line naming process_count (recorded 2, here 1): the
cross-process gradient reduction rounds otherwise. `replay bisect` works from one process: the
learning-rate pair is named at its step as `update` (its refining replays measured, said in a
note), and the run against a one-process run of the same loop is noise whose cause is the
environment (process_count 2 vs 1), data and RNG equal. Not built: replay without the loop's
code (a multi-process run keeps no example store, so the exported program has no batches).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import json

import numpy as np
import pytest

from replay.record.hashing import example_hashes
from tests.ports import free_port
from traces import Run, compare

HERE = Path(__file__).resolve().parent / "multihost"
sys.path.insert(0, str(HERE))
import mh_loop  # noqa: E402

pytestmark = pytest.mark.slow


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "REPLAY_DEBUG")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    return env


def record(path: Path, processes: int, lr: float) -> Run:
    port = str(free_port())
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
            "lr": record(root / "lr", 2, 0.2), "one": record(root / "one", 1, 0.1)}


def replay_cli(*args: str, processes: int = 1) -> list[tuple[int, str, str]]:
    """`replay ARGS` started once per process (4 CPU devices in all, as recorded), each with its
    --process-id; (exit code, stdout, stderr) of each."""
    port = str(free_port())
    ranks = lambda pid: ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),  # noqa: E731
                         "--process-id", str(pid)] if processes > 1 else []
    procs = [subprocess.Popen([sys.executable, "-m", "replay.cli.app", *args, *ranks(pid)], cwd=HERE,
                              env=_env(4 // processes), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in range(processes)]
    outs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outs)]


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


def test_replay_on_two_processes_is_bit_exact_and_only_process_0_reports(runs):
    (rc0, out0, err0), (rc1, out1, err1) = replay_cli("run", str(runs["two"].path), "--steps", "1:5", "--allow-code",
                                                      "--json", processes=2)
    assert (rc0, rc1) == (0, 0), (err0[-2000:], err1[-2000:])
    report = json.loads(out0.strip().splitlines()[-1])
    assert report["contract"]["expect_bits"] and report["all_bit_exact"], report
    assert (report["replayed"], report["bit_exact"], report["warmup_bit_exact"]) == (5, 5, 1), report
    # (jax's CPU collectives print their own "[Gloo] ..." lines on stdout; replay prints nothing there)
    assert not any(line.startswith("{") for line in out1.splitlines()) and "error" not in err1, (out1, err1)


def test_replay_in_one_process_is_measured_and_names_the_process_count(runs):
    ((rc, out, err),) = replay_cli("run", str(runs["two"].path), "--steps", "0:5", "--allow-code", "--json")
    report = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and not report["contract"]["expect_bits"], (rc, err[-2000:])
    assert "process_count (recorded 2, here 1)" in report["contract"]["line"], report["contract"]
    assert any("--num-processes 2" in note for note in report["notes"]), report["notes"]


def test_bisect_of_a_learning_rate_change_on_two_processes_names_the_step_and_update(runs):
    ((rc, out, err),) = replay_cli("bisect", str(runs["two"].path), str(runs["lr"].path), "--allow-code", "--json")
    report = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and (report["first_step"], report["cause"]) == (0, "update"), (rc, err[-2000:], report)
    # Refined by replays in this one process: measured, and said so.
    assert any("recorded on 2 processes, replayed here in 1" in note for note in report["notes"]), report["notes"]


def test_bisect_of_two_processes_against_one_names_the_process_count_not_a_layer(runs):
    ((rc, out, err),) = replay_cli("bisect", str(runs["two"].path), str(runs["one"].path), "--allow-code", "--json")
    report = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and report["noise_only"] and not report["bits_expected"], (rc, err[-2000:], report)
    assert (report["cause"], report["layer"]) == ("environment", None), report
    because = {d["key"]: (d["a"], d["b"]) for d in report["noise"]["because"]}
    assert because["process_count"] == (2, 1) and report["noise"]["inputs"]["equal"], report["noise"]


def test_process_flags_without_a_coordinator_are_one_line():
    from tests.cli_util import assert_error_line, invoke

    assert_error_line(invoke("run", str(HERE), "--num-processes", "2", "--process-id", "1"), 2, "--coordinator")


def test_rounding_noise_never_covers_runs_fed_different_data():
    from types import SimpleNamespace

    from replay.bisect import BisectReport, _inputs

    def run(*fed):
        records = [SimpleNamespace(example_hashes=np.array(h, np.uint64), rng=np.array(r, np.uint32)) for h, r in fed]
        return SimpleNamespace(trace=SimpleNamespace(read=records.__getitem__))

    a = run(([1, 2], [7]), ([3, 4], [8]), ([5, 6], [9]))
    assert _inputs(a, run(([1, 2], [7]), ([3, 4], [8]), ([5, 6], [9])), 0, 3)["equal"]
    fed = _inputs(a, run(([1, 2], [7]), ([3, 9], [8]), ([5, 6], [9])), 0, 3)
    assert (fed["equal"], fed["step"], fed["kind"]) == (False, 1, "data"), fed
    assert _inputs(a, run(([1, 2], [7]), ([3, 4], [8]), ([5, 6], [0])), 0, 3)["kind"] == "rng"
    scan = SimpleNamespace(first=SimpleNamespace(kind="backward"), first_step=0)
    noise = {"above": False, "because": [{"key": "process_count"}]}
    assert BisectReport("A", "B", [], scan, noise={**noise, "inputs": {"equal": True}}).cause == "environment"
    report = BisectReport("A", "B", [], scan, noise={**noise, "inputs": fed})
    assert not report.noise_only and report.cause == "backward"


def test_a_replay_without_the_code_names_the_process_count_not_store_examples(runs):
    """A run of several processes keeps no example store (store_examples is refused there), so the
    exported program has no batches to run on: the refusal says so, instead of suggesting the
    store_examples=True that recording would refuse."""
    from tests.cli_util import invoke

    result = invoke("run", str(runs["two"].path), "--steps", "4:5")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "recorded on 2 processes, which keep no example store" in result.stderr, result.stderr
    assert "store_examples=True" not in result.stderr, result.stderr
