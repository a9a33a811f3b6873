"""The trainer (tiny preset) records to a bucket (moto's S3 server and gcp-storage-emulator on
127.0.0.1): `replay train --out s3://...` (gs://...), `replay run` of the remote run bit-exact from
its checkpoint, `replay train --resume URL` continuing it, and `bisect` against the same run trained
to disk: identical. The local run is trained once for both stores (the same config and steps)."""

from __future__ import annotations

import json

import pytest

from tests.cli_util import invoke


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> str:
    """The same run trained to disk straight through (9 steps)."""
    out = str(tmp_path_factory.mktemp("local") / "run")
    straight = invoke("train", "--preset", "tiny", "--steps", "9", "--out", out, "--json")
    assert straight.exit_code == 0, straight.output
    return out


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_the_trainer_records_replays_and_resumes_a_run_in_a_bucket(tmp_path, store, request, local, monkeypatch):
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url = f"{request.getfixturevalue(store)}/{tmp_path.name}/run"
    trained = invoke("train", "--preset", "tiny", "--steps", "6", "--out", url, "--json")
    assert trained.exit_code == 0, trained.output
    assert json.loads(trained.stdout)["checkpoints"] == [0, 6]
    assert json.loads(trained.stdout)["run"] == url  # named as given, with its "//"
    replayed = invoke("run", url, "--steps", "1:4", "--json")
    assert replayed.exit_code == 0, replayed.output
    report = json.loads(replayed.stdout)
    assert report["checkpoint"] == 0 and report["all_bit_exact"] and report["bit_exact"] == 4, report
    staged, uploaded = _watch_the_resume(monkeypatch)
    resumed = invoke("train", "--resume", url, "--steps", "9", "--json")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["started_at"] == 6
    # The resume staged checkpoint 0 as an empty folder and fetched only 6, the one it restored
    # (9 it wrote); what it fetched it did not upload again (traces/storage/mirror.py download).
    folder = staged[0] / "checkpoints"
    assert {p.name: any(p.iterdir()) for p in folder.iterdir() if p.name.isdigit()} == {"0": False, "6": True, "9": True}
    assert not [rel for rel in uploaded if rel.startswith(("checkpoints/0/", "checkpoints/6/"))], uploaded
    shown = json.loads(invoke("show", "--json", url).stdout)
    assert shown["status"] == "complete" and shown["steps"]["count"] == 9 and shown["damage"] == []
    bisect = invoke("bisect", "--json", local, url)
    assert bisect.exit_code == 0, bisect.output
    assert json.loads(bisect.stdout)["identical"] is True


def _watch_the_resume(monkeypatch) -> tuple[list, list]:
    """The resumed writer's staging folder (kept, not removed at close) and what it uploaded."""
    from traces.storage import mirror

    staged: list = []
    uploaded: list = []
    close, put = mirror.Mirror.close, mirror.Mirror.put

    def keep(self, remove_staging=True):
        staged.append(self.staging)
        close(self, remove_staging=False)

    def record(self, rel, data, replace=False):
        uploaded.append(rel)
        return put(self, rel, data, replace)

    monkeypatch.setattr(mirror.Mirror, "close", keep)
    monkeypatch.setattr(mirror.Mirror, "put", record)
    return staged, uploaded
