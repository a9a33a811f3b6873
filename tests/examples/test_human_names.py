"""Tensors are shown with the names people know (replay/engine/human_names.py): an in-place NNX
step's leaves without `.value` and with its nodes named (`update/model.conv.kernel`, not
`update/0.conv.kernel.value`) in the tables bisect prints, the raw names kept in --json."""

from __future__ import annotations

import pytest

from tests.cli_util import invoke, last_json
from tests.examples import loops  # noqa: F401  (puts examples/ on sys.path)
from replay.engine.human_names import namer
from traces import Run

import nnx_mnist  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("names")
    return {name: nnx_mnist.train(nnx_mnist.Config(steps=4, checkpoint_every=2, **bug), str(root / name))
            for name, bug in (("clean", {}), ("lr", {"lr_bump_at": 2}))}


def test_the_nodes_are_named_in_run_json_and_shown_by_name(runs):
    manifest = Run.open(runs["clean"]).manifest
    assert manifest["state_names"] == {"0": "model", "1": "optimizer"}
    shown = namer(manifest)
    assert shown("update/0.conv.kernel.value") == "update/model.conv.kernel"
    assert shown("state/1.opt_state.0.mu.conv.kernel.value") == "state/optimizer.opt_state.0.mu.conv.kernel"
    assert shown("grad/linear.bias.value") == "grad/linear.bias" and shown("loss") == "loss"


def test_bisect_tables_show_human_names_and_json_keeps_the_raw_ones(runs):
    result = invoke("bisect", runs["clean"], runs["lr"], "--json")
    report = last_json(result)
    assert result.exit_code == 1 and report["first_step"] == 2, result.output
    raw = [f["name"] for f in report["fields"] if f["name"].startswith("update/")]
    assert raw and all(name.endswith(".value") and name.startswith(("update/0.", "update/1.")) for name in raw), raw
    text = invoke("bisect", runs["clean"], runs["lr"]).stdout
    assert "update/model." in text and ".value" not in text and "update/0." not in text, text[-3000:]
