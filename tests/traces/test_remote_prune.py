"""A run recorded by one process to a bucket keeps what `keep_checkpoints` keeps there too: the
checkpoints orbax prunes in the staging folder are deleted in the bucket once the manifest that
no longer names them is uploaded, in a new run and in a resumed one (whose other checkpoints
were staged as empty folders: traces/storage/mirror.py `prune`)."""

from __future__ import annotations

import pytest

import replay
from tests.replay.test_record_api import batch_at, make
from traces import Run, storage


@pytest.fixture(params=["gcs", "s3"])
def bucket(request):
    return request.getfixturevalue(request.param)


def bucket_steps(url: str) -> list[int]:
    store, key = storage.open_store(url)
    return sorted(int(d) for d in store.list(key + "/checkpoints/")[1])


def record(url: str, first: int, last: int, keep: int, state=None) -> None:
    loop = make({"scale": 1.0})
    run = replay.init(url, config={"scale": 1.0}, entrypoint=make, keep_checkpoints=keep, resume=first > 0)
    step = run.step(loop.step)
    state = run.restore(like=loop.init()) if first > 0 else loop.init()
    assert run.next_step == first
    for k in range(first, last):
        if k > first or first == 0:  # (a resume's first state is the checkpoint it restored)
            run.save(k, state)
        state, _ = step(state, batch_at(k))
    run.finish()


def test_checkpoints_pruned_under_keep_are_deleted_in_the_bucket(tmp_path, bucket, monkeypatch):
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url = f"{bucket}/{tmp_path.name}/run"
    record(url, 0, 5, keep=2)
    assert bucket_steps(url) == [3, 4] and Run.open(url).manifest["checkpoints"] == [3, 4]
    record(url, 4, 8, keep=2)  # resumed from 4: 3 was staged empty and is pruned like the rest
    assert bucket_steps(url) == [6, 7] and Run.open(url).manifest["checkpoints"] == [6, 7]


def test_without_keep_every_checkpoint_stays(tmp_path, s3, monkeypatch):
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url = f"{s3}/{tmp_path.name}/run"
    record(url, 0, 4, keep=0)
    assert bucket_steps(url) == [0, 1, 2, 3]
