"""Several processes recording one run to object storage: refused on every process, before
anything is written, in one line that says what to do (replay/record/run.py). Why: orbax's
multi-process save has process 0 merge the checkpoint files every process wrote (ocdbt.process_N/,
array_metadatas/process_N) in one folder, which per-host staging folders are not, so process 0's
merge would leave the other hosts' shards out (traces/storage/DESIGN.md, "Several processes")."""

from __future__ import annotations

import pytest

import replay
from replay.record import run_open
from replay.record.errors import RecordError
from tests.examples import loops  # noqa: F401 - puts examples/ on sys.path
from tests.traces.emulators import s3  # noqa: F401 - fixture
from traces import storage

import optax_loop  # noqa: E402


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_of_two_processes_to_a_bucket_is_refused_in_one_line_before_anything_is_written(
        tmp_path, s3, monkeypatch, resume):  # noqa: F811
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url = f"{s3}/{tmp_path.name}/run"
    store, key = storage.open_store(url)
    if resume:  # a crashed one-process run to continue (created, nothing recorded, closed INCOMPLETE)
        replay.init(url, config={"steps": 1}, entrypoint=optax_loop.make).close()
    before = _objects(store, key)
    monkeypatch.setattr(run_open, "processes", lambda: 2)  # this process is process 0 of two
    with pytest.raises(RecordError) as refused:
        replay.init(url, config={"steps": 1}, entrypoint=optax_loop.make, resume=resume)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{url}: ") and "2 processes" in line, line
    assert "shared folder" in line and "copy" in line, line
    assert _objects(store, key) == before and bool(before) == resume, before
    assert not list(tmp_path.glob("replay-staging-*")), "a staging folder was made for a refused run"


def _objects(store, key: str) -> dict:
    """Every object under `key` with its generation: a refused init changes none."""
    found, stack = {}, [key]
    while stack:
        folder = stack.pop()
        files, folders = store.list(folder + "/")
        found.update({f"{folder}/{name}": store.stat(f"{folder}/{name}").generation for name in files})
        stack += [f"{folder}/{d}" for d in folders]
    return found
