"""A user's loop (examples/optax_loop.py) recorded through `replay.init("s3://...")` into a real
emulator (tests/traces/emulators.py): `replay show`, `audit` and `bisect` of the remote run say what
they say of the same loop recorded to disk, and its checkpoints, exported program and example store
are in the bucket."""

from __future__ import annotations

import json

import pytest

from tests.cli_util import invoke
from tests.examples import loops
from traces import storage

import optax_loop  # noqa: E402 - tests.examples.loops puts examples/ on sys.path

STEPS = 12


@pytest.fixture(params=["gcs", "s3"])
def bucket(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "run"
    return optax_loop.train(optax_loop.Config(steps=STEPS, checkpoint_every=5), str(out))


def test_a_loop_recorded_to_a_bucket_reads_as_the_same_loop_recorded_to_disk(tmp_path, bucket, local_run, monkeypatch):
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url = f"{bucket}/{tmp_path.name}/run"
    assert optax_loop.train(optax_loop.Config(steps=STEPS, checkpoint_every=5), url) == url
    store, key = storage.open_store(url)
    top = store.list(key + "/")
    assert {"run.json", "COMPLETE"} <= set(top[0]) and "checkpoints" in top[1], top
    assert sorted(store.list(key + "/checkpoints/")[1]) == ["0", "10", "12", "5"]
    for command in (["show", "--json"], ["audit", "--json"]):
        here, there = invoke(*command, local_run), invoke(*command, url)
        assert here.exit_code == there.exit_code, there.output
        mine, theirs = json.loads(there.stdout.replace(url, local_run)), json.loads(here.stdout)
        assert mine == theirs, command
    bisect = invoke("bisect", "--no-refine", "--json", local_run, url)
    assert bisect.exit_code == 0, bisect.output
    assert not list(tmp_path.glob("replay-staging-*")), "the staging folder outlived its run"


def test_replaying_a_remote_run_restores_its_checkpoints_bit_exact(tmp_path, s3, monkeypatch):  # noqa: F811
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url = f"{s3}/{tmp_path.name}/run"
    optax_loop.train(optax_loop.Config(steps=STEPS, checkpoint_every=5), url)
    result = invoke("run", url, "--steps", "6:9", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["checkpoint"] == 5 and (report["replayed"], report["bit_exact"]) == (4, 4), report
    assert report["all_bit_exact"] and report["contract"]["expect_bits"], report
