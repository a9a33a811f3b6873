"""Two processes recording one run to gs:// (gcp-storage-emulator on 127.0.0.1): the user loop of
tests/replay/multihost/mh_loop.py under jax.distributed, two CPU devices each. Process 0 owns the
trace, run.json, the markers and the lease through traces/storage (staged and uploaded); every
process's orbax saves its shards straight to URL/checkpoints (tensorstore's gcs driver and gcsfs
through etils.epath, pointed at the emulator), the one folder orbax's multi-process save needs;
process 1's example hashes reach process 0 on device, as in a local two-process run.

Checked: the bucket's run is the same run as one recorded by two processes to a local folder
(traces bit-identical, `replay bisect` identical), its checkpoints hold both processes' files in
the bucket and none in a staging folder, and `replay run URL --num-processes 2` replays it
bit-exact (each process restoring from its own download). The same for the trainer (tiny preset,
asynchronous checkpoints; the run on gs:// against the same run on two processes to a local
folder), which needs the emulator to answer object reads with their generation as GCS does
(tests/traces/emulators.py `reads_like_gcs`). The example loop also to s3:// on moto (orbax's
arrays through tensorstore's s3 driver, its folders through s3fs: replay/record/checkpoints.py
`location`), and one checkpoint saved and restored there in one process (cheap)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_util import invoke
from tests.ports import free_port
from tests.replay.test_multihost_loop import mh_loop, record, replay_cli
from traces import compare, storage

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("bucket", ["gcs", "s3"])
def test_two_processes_record_to_a_bucket_replay_bit_exact_and_bisect_identical_to_a_local_run(
        tmp_path, bucket, request, monkeypatch):
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url = f"{request.getfixturevalue(bucket)}/{tmp_path.name}/two"
    remote = record(url, 2, 0.1)
    local = record(tmp_path / "local", 2, 0.1)
    assert remote.status == "complete" and remote.trace.end == mh_loop.STEPS, remote.status
    assert remote.manifest["environment"]["process_count"] == 2 and remote.manifest["checkpoints"] == [0, 3, 6]
    assert compare(remote.trace, local.trace).identical

    store, key = storage.open_store(url)
    files = _objects(store, f"{key}/checkpoints")
    for k in (0, 3, 6):  # orbax's merged manifest and each process's own files, in the bucket
        assert f"{k}/default/manifest.ocdbt" in files and f"{k}/commit_success.txt" in files, sorted(files)
        assert {f"{k}/default/ocdbt.process_{p}/manifest.ocdbt" for p in (0, 1)} <= files, sorted(files)
    assert not list(tmp_path.glob("replay-staging-*/run/checkpoints")), "checkpoints were staged"

    bisect = invoke("bisect", url, str(tmp_path / "local"), "--allow-code", "--json")
    assert bisect.exit_code == 0, bisect.output
    assert json.loads(bisect.stdout)["identical"], bisect.stdout

    (rc0, out0, err0), (rc1, _, err1) = replay_cli("run", url, "--steps", "1:5", "--allow-code", "--json",
                                                   processes=2)
    assert (rc0, rc1) == (0, 0), (err0[-2000:], err1[-2000:])
    report = json.loads(out0.strip().splitlines()[-1])
    assert report["contract"]["expect_bits"] and report["all_bit_exact"], report
    assert (report["replayed"], report["bit_exact"]) == (5, 5), report


TIMEOUT_S = 300  # each command takes 20-60 s here
TRAIN = ("train", "--preset", "tiny", "--steps", "4", "--set", "checkpoint.every_steps=2", "--json")


@pytest.mark.slow
def test_the_trainer_on_two_processes_records_to_gs_replays_bit_exact_and_bisects_identical_to_a_local_run(
        tmp_path, gcs, monkeypatch):  # noqa: F811
    """`replay train` on two processes (one CPU device each) to gs://: checkpoint 0 synchronous,
    2 asynchronous, 4 waited for; every process's orbax writes its shards to the bucket."""
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url, local = f"{gcs}/{tmp_path.name}/trainer", tmp_path / "local"
    for out in (url, str(local)):
        (rc0, out0, err0), (rc1, _, err1) = _two_processes(*TRAIN, "--out", out)
        assert (rc0, rc1) == (0, 0), (err0[-2000:], err1[-2000:])
        assert json.loads(out0.strip().splitlines()[-1])["checkpoints"] == [0, 2, 4], out0
    store, key = storage.open_store(url)
    files = _objects(store, f"{key}/checkpoints")
    for k in (0, 2, 4):  # each process's shards and array metadata, and orbax's merged manifest
        assert {f"{k}/default/manifest.ocdbt", f"{k}/commit_success.txt"} <= files, sorted(files)
        mine = {f"{k}/default/{f}" for p in (0, 1) for f in (f"ocdbt.process_{p}/manifest.ocdbt",
                                                              f"array_metadatas/process_{p}")}
        assert mine <= files, sorted(files)

    bisect = invoke("bisect", url, str(local), "--json")
    assert bisect.exit_code == 0, bisect.output
    assert json.loads(bisect.stdout)["identical"], bisect.stdout
    (rc0, out0, err0), (rc1, _, err1) = _two_processes("run", url, "--steps", "0:3", "--json")
    assert (rc0, rc1) == (0, 0), (err0[-2000:], err1[-2000:])
    report = json.loads(out0.strip().splitlines()[-1])
    assert report["contract"]["expect_bits"] and report["all_bit_exact"], report
    assert (report["checkpoint"], report["replayed"], report["bit_exact"]) == (0, 4, 4), report


def _two_processes(*args: str) -> list[tuple[int, str, str]]:
    """`replay ARGS` as two processes of one jax.distributed job on 127.0.0.1, one CPU device each."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "REPLAY_DEBUG")} | {"JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-m", "replay.cli.app", *args, "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(pid)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for pid in range(2)]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:  # a stalled save: fail with what each process said, leave none running
        for p in procs:
            p.kill()
        outs = [p.communicate() for p in procs]
        outs = [(out, f"{err}\n(killed after {TIMEOUT_S} s)") for out, err in outs]
    return [(p.returncode, *out) for p, out in zip(procs, outs)]


def _objects(store, key: str) -> set[str]:
    """Every object under `key`, named from there."""
    found, stack = set(), [key]
    while stack:
        folder = stack.pop()
        files, folders = store.list(folder + "/")
        found |= {f"{folder}/{name}"[len(key) + 1:] for name in files}
        stack += [f"{folder}/{d}" for d in folders]
    return found


def test_orbax_saves_to_s3_itself_and_restores_the_same_bits(tmp_path, s3):  # noqa: F811
    """What several processes' checkpoints to s3:// rest on, in one process (cheap): orbax 0.12.8
    alone fails an s3:// save; through checkpoints.location it writes the bucket with tensorstore's
    s3 driver at AWS_ENDPOINT_URL (moto) and commits with commit_success.txt (no rename)."""
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    from replay.record import checkpoints

    url = f"{s3}/{tmp_path.name}/checkpoints"
    manager = checkpoints.open_manager(url, read_only=False)
    state = {"w": jnp.arange(8.0), "b": jnp.ones((3, 4), jnp.bfloat16)}
    manager.save(0, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    files = _objects(*storage.open_store(url))
    assert {"0/commit_success.txt", "0/default/manifest.ocdbt", "0/default/ocdbt.process_0/manifest.ocdbt"} <= files, files
    assert not any("tmp" in f for f in files), files
    restored = checkpoints.open_manager(url, read_only=True).restore(0, args=ocp.args.StandardRestore(state))
    for k in state:
        assert np.asarray(restored[k]).tobytes() == np.asarray(state[k]).tobytes(), k
