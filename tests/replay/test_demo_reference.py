"""`replay demo --reference torch`: the reference and the JAX trainer agree within the noise floor,
and the planted port bug is found at the expected step, layer and cause (the CLI, in-process).
The demo runs once per test session (tests/torch/reference_pair.py): its runs are also the pair
of the port-bug table, `compare --eval` and the cross-framework bisect tests."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.cli_util import invoke  # noqa: E402
from tests.torch.reference_pair import DEMO_STEPS, demo  # noqa: E402

pytestmark = pytest.mark.slow  # the demo: three short trainings and two cross-framework bisects


def test_the_reference_demo_agrees_clean_and_finds_the_rope_bug():
    r = demo()  # `replay demo --reference torch --steps 8 --out DIR --json`
    assert r["exit_code"] == 0, r["output"]
    j = json.loads(r["stdout"].strip().splitlines()[-1])
    assert DEMO_STEPS == 8 and j["steps"] == 8 and j["port"] == str(r["jax"]) and j["buggy_port"] == str(r["rope"])
    assert j["clean"]["within_noise"] is True and j["clean"]["steps_examined"] == 8
    assert j["clean"]["inputs"]["data"]["equal"] and j["clean"]["inputs"]["init"]["equal"]
    assert j["buggy"]["within_noise"] is False
    assert (j["buggy"]["first_step"], j["buggy"]["first_layer"], j["buggy"]["cause"]) == (0, "block_00.attn", "forward")
    assert j["found_as_expected"] is True
    if j["eval"] is not None:  # the reference saved checkpoints: they agree at early, middle, late
        assert j["eval"]["agree"] and len(j["eval"]["steps"]) == 3


def test_bad_options_are_one_line_errors(tmp_path):
    for argv, words in ((["--reference", "jax"], "only reference"), (["--reference", "torch", "--bug", "x"],
                                                                       "not a port bug"),
                        (["--reference", "torch", "--steps", "3"], "at least 8 steps"),
                        (["--bug", "rope"], "add --reference torch")):
        r = invoke("demo", *argv, "--out", str(tmp_path / "d"))
        assert r.exit_code == 2 and words in r.output and r.output.count("error:") == 1, r.output
        assert not (tmp_path / "d").exists()
