"""A replay.torch run in a bucket (copied there: replay.torch records to a folder): `compare --eval`
against its JAX port and the cross-framework bisect read its torch checkpoints from the run's local
copy (traces/storage/mirror.py) and answer as they do on disk. Before, both stopped with exit 3
(a RemotePath where a folder was expected: the trainer's data view and the torch checkpoints).

Reads the session's shared `replay demo --reference torch` runs (tests/torch/reference_pair.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from tests.cli_util import invoke  # noqa: E402
from tests.torch.reference_pair import demo  # noqa: E402
from tests.traces.emulators import upload  # noqa: E402

READS_SHARED_RUNS = True  # tests/conftest.py orders this file after the ones that make them
pytestmark = pytest.mark.slow


def _report(result) -> dict:
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return {k: v for k, v in report.items() if k not in ("run_a", "run_b")}


def test_a_torch_run_in_a_bucket_compares_and_bisects_as_on_disk(s3):  # noqa: F811
    runs = demo()
    urls = {name: upload(runs[name], f"{s3}/torch-pair/{name}") for name in ("reference", "jax", "rope")}

    local = invoke("compare", str(runs["reference"]), str(runs["jax"]), "--eval", "--json")
    remote = invoke("compare", urls["reference"], urls["jax"], "--eval", "--json")
    assert (local.exit_code, remote.exit_code) == (0, 0), remote.output[-2000:]
    assert _report(remote) == _report(local) and _report(local)["agree"] is True
    assert json.loads(remote.stdout.strip().splitlines()[-1])["run_a"] == urls["reference"]  # named as given

    # the RoPE port bug: found remotely as on disk, down to the op (the refinement re-runs the torch step
    # from the run's checkpoint)
    local = invoke("bisect", str(runs["reference"]), str(runs["rope"]), "--json")
    remote = invoke("bisect", urls["reference"], urls["rope"], "--json")
    assert (local.exit_code, remote.exit_code) == (1, 1), remote.output[-2000:]
    a, b = _report(local), _report(remote)
    assert (b["first_step"], b["first_layer"], b.get("first_op")) == (a["first_step"], a["first_layer"], a.get("first_op"))
    assert b.get("first_op"), b
