"""Two processes recording one run to gs:// (gcp-storage-emulator on 127.0.0.1): the user loop of
tests/replay/multihost/mh_loop.py under jax.distributed, two CPU devices each. Process 0 owns the
trace, run.json, the markers and the lease through traces/storage (staged and uploaded); every
process's orbax saves its shards straight to URL/checkpoints (tensorstore's gcs driver and gcsfs
through etils.epath, pointed at the emulator), the one folder orbax's multi-process save needs;
process 1's example hashes reach process 0 on device, as in a local two-process run.

Checked: the bucket's run is the same run as one recorded by two processes to a local folder
(traces bit-identical, `replay bisect` identical), its checkpoints hold both processes' files in
the bucket and none in a staging folder, and `replay run URL --num-processes 2` replays it
bit-exact (each process restoring from its own download). Still refused, in one line: several
processes to s3:// (built for gs:// only)."""

from __future__ import annotations

import json

import pytest

import replay
from replay.record import run_open
from replay.record.errors import RecordError
from tests.cli_util import invoke
from tests.examples import loops  # noqa: F401 - puts examples/ on sys.path
from tests.replay.test_multihost_loop import mh_loop, record, replay_cli
from tests.traces.emulators import gcs, s3  # noqa: F401 - fixtures
from traces import compare, storage

import optax_loop  # noqa: E402


@pytest.mark.slow
def test_two_processes_record_to_gs_replay_bit_exact_and_bisect_identical_to_a_local_run(
        tmp_path, gcs, monkeypatch):  # noqa: F811
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url = f"{gcs}/{tmp_path.name}/two"
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


def _objects(store, key: str) -> set[str]:
    """Every object under `key`, named from there."""
    found, stack = set(), [key]
    while stack:
        folder = stack.pop()
        files, folders = store.list(folder + "/")
        found |= {f"{folder}/{name}"[len(key) + 1:] for name in files}
        stack += [f"{folder}/{d}" for d in folders]
    return found


def test_two_processes_to_s3_are_refused_in_one_line_before_anything_is_written(tmp_path, s3, monkeypatch):  # noqa: F811
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url = f"{s3}/{tmp_path.name}/run"
    monkeypatch.setattr(run_open, "processes", lambda: 2)  # this process is process 0 of two
    with pytest.raises(RecordError) as refused:
        replay.init(url, config={"steps": 1}, entrypoint=optax_loop.make)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{url}: ") and "2 processes to s3://" in line, line
    assert _objects(*storage.open_store(url)) == set() and not list(tmp_path.glob("replay-staging-*"))
