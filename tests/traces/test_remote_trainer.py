"""The trainer (tiny preset) records to a bucket (moto's S3 server on 127.0.0.1): `replay train
--out s3://...`, `replay run` of the remote run bit-exact from its checkpoint, `replay train
--resume s3://...` continuing it, and `bisect` against the same run trained to disk: identical."""

from __future__ import annotations

import json

import pytest

from tests.cli_util import invoke
from tests.traces.emulators import s3  # noqa: F401 - fixtures


@pytest.mark.slow
def test_the_trainer_records_replays_and_resumes_a_run_in_a_bucket(tmp_path, s3, monkeypatch):  # noqa: F811
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))
    url, local = f"{s3}/{tmp_path.name}/run", str(tmp_path / "local")
    trained = invoke("train", "--preset", "tiny", "--steps", "6", "--out", url, "--json")
    assert trained.exit_code == 0, trained.output
    assert json.loads(trained.stdout)["checkpoints"] == [0, 6]
    assert json.loads(trained.stdout)["run"] == url  # named as given, with its "//"
    replayed = invoke("run", url, "--steps", "1:4", "--json")
    assert replayed.exit_code == 0, replayed.output
    report = json.loads(replayed.stdout)
    assert report["checkpoint"] == 0 and report["all_bit_exact"] and report["bit_exact"] == 4, report
    resumed = invoke("train", "--resume", url, "--steps", "9", "--json")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["started_at"] == 6
    straight = invoke("train", "--preset", "tiny", "--steps", "9", "--out", local, "--json")
    assert straight.exit_code == 0, straight.output
    shown = json.loads(invoke("show", "--json", url).stdout)
    assert shown["status"] == "complete" and shown["steps"]["count"] == 9 and shown["damage"] == []
    bisect = invoke("bisect", "--json", local, url)
    assert bisect.exit_code == 0, bisect.output
    assert json.loads(bisect.stdout)["identical"] is True
