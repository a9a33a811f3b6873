"""The noise floor measured from a rounding-level twin of one side (replay/bisect/twin_floor.py,
`bisect --floor twin:PATH`), on small synthetic traces: a MaxText-recorded run A, an OLMo-core-recorded B,
and a twin of A whose distance to A grows 2x every 4 steps (rounding amplified by training)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from replay.bisect.cross import cross_bisect
from replay.bisect.cross_floor import OLMO3_PAIR
from replay.bisect.twin_floor import twin_floor
from replay.errors import UserError
from tests.traces.helpers import drifting_run
from traces import Schema

W, STEPS, LATE = 16, 40, 36
TENSORS = (("embeddings", "forward"), ("blocks.0.attention.w_q", "forward"))
SCHEMA = Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),), tensors=TENSORS, sketch_width=W)
MAXTEXT = {"loop": "maxtext", "environment": {"framework": "jax"}, "config": {"lr": 1e-3}}
OLMO_CORE = {"recorded_by": "replay.torch", "olmo_core": {"fits": []}, "config": {"lr": 1e-3}}


def twin_drift(k: int) -> float:
    return 1e-6 * 2 ** (k / 4)  # 1e-6 at step 0, 5.1e-4 at step 36


EVENT = 2 * twin_drift(LATE)  # 1.0e-3: within 10 x the twin's distance at step 36, ~90 x it at step 1


def _write(path, manifest: dict, drift=lambda k: 0.0, steps: int = STEPS):
    return drifting_run(path, SCHEMA, manifest, steps, drift)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("twin")
    return {"a": _write(root / "a", MAXTEXT),
            "twin": _write(root / "twin", {**MAXTEXT, "config": {"lr": 1e-3, "twin": "init +1 ULP"}}, twin_drift),
            "same": _write(root / "same", MAXTEXT),  # a twin identical to A: distance 0 everywhere
            "late": _write(root / "late", OLMO_CORE, lambda k: EVENT if k >= LATE else 3e-7),
            "early": _write(root / "early", OLMO_CORE, lambda k: EVENT if k >= 1 else 3e-7),
            "rounding": _write(root / "rounding", OLMO_CORE, lambda k: 3e-7)}


def test_a_growing_twin_passes_a_late_difference_and_names_an_early_one_of_the_same_size(runs):
    a, twin = runs["a"], runs["twin"]
    late = cross_bisect(a, runs["late"], floor=twin_floor("twin", a, runs["late"], twin))
    assert late.within_noise and 0.1 < late.max_ratio < 0.5, late.to_json()
    assert late.to_json()["floor_table"]["name"] == "twin:twin"
    early = cross_bisect(a, runs["early"], floor=twin_floor("twin", a, runs["early"], twin))
    assert not early.within_noise and early.first_step == 1, early.to_json()
    assert early.first_layer == "blocks.0.attention.w_q" and early.ratio > 50, early.to_json()
    table = cross_bisect(a, runs["early"])  # the pair's measured table is wide from step 1: the same event passes
    assert table.noise is OLMO3_PAIR and table.within_noise, table.to_json()


def test_a_twin_identical_to_its_side_falls_back_to_the_tables_step_0_floor(runs):
    a, same = runs["a"], runs["same"]
    floor = twin_floor("same", a, runs["rounding"], same)
    assert floor.at("forward", 30) == OLMO3_PAIR.at("forward", 0) > 0  # not 10 x 0: the table's step 0
    rounding = cross_bisect(a, runs["rounding"], floor=floor)  # kernel rounding at every step: not a divergence
    assert rounding.within_noise and 0.01 < rounding.max_ratio < 0.1, rounding.to_json()
    late = cross_bisect(a, runs["late"], floor=twin_floor("same", a, runs["late"], same))
    assert late.first_step == LATE and late.ratio > 50, late.to_json()  # no growth measured: the late event is named


def test_the_python_api_takes_the_floor_twin_path_as_the_cli_does(runs, tmp_path):
    """cross_bisect(floor="twin:PATH") opens the twin itself: the report of a twin_floor built by hand,
    and a different twin gives a different one (so the path is not ignored)."""
    a, twin, early = runs["a"], runs["twin"], runs["early"]
    by_path = cross_bisect(a, early, floor=f"twin:{twin.path}").to_json()
    assert by_path == cross_bisect(a, early, floor=twin_floor(str(twin.path), a, early, twin)).to_json()
    assert by_path["first_step"] == 1 and by_path["floor_table"]["name"] == f"twin:{twin.path}"
    same = cross_bisect(a, early, floor=f"twin:{runs['same'].path}").to_json()
    assert same["floor_table"] != by_path["floor_table"]
    other = _write(tmp_path / "other", {**MAXTEXT, "config": {"lr": 2e-3}}).path
    with pytest.raises(UserError) as e:
        cross_bisect(a, early, floor=f"twin:{other}")
    assert e.value.exit_code == 2 and "config is not run A's" in str(e.value) and "\n" not in str(e.value)


def test_a_twin_not_of_either_side_is_a_one_line_error(runs, tmp_path):
    a, b = runs["a"], runs["early"]
    bad = {"framework": _write(tmp_path / "f", {**MAXTEXT, "environment": {"framework": "tensorflow"}}),
           "config": _write(tmp_path / "c", {**MAXTEXT, "config": {"lr": 2e-3}}),
           "short": _write(tmp_path / "s", MAXTEXT, steps=STEPS - 1),
           "sparse": drifting_run(tmp_path / "sp", SCHEMA, MAXTEXT, STEPS, layer_every=2)}  # sketches every 2 steps
    for why, twin in bad.items():
        with pytest.raises(UserError) as e:
            twin_floor(why, a, b, twin)
        assert e.value.exit_code == 2 and "\n" not in str(e.value), why
        if why == "sparse":
            assert "sketches at 20 of the 40 common steps of A and B (not at step 1)" in str(e.value), e.value
    assert twin_floor("of B", a, b, _write(tmp_path / "b2", OLMO_CORE)).side is b  # a twin of the other side
    side = drifting_run(tmp_path / "side", SCHEMA, MAXTEXT, STEPS, layer_every=2)  # the side sketched every 2 steps
    with pytest.raises(UserError, match="both record distance sketches at 20 of the 40 common steps"):
        twin_floor("every", side, b, _write(tmp_path / "every", MAXTEXT))


def test_the_cli_takes_floor_twin_and_refuses_it_for_one_framework(runs, tmp_path):
    from typer.testing import CliRunner

    from replay.cli.app import app

    a, twin = str(runs["a"].path), str(runs["twin"].path)
    cli = CliRunner()
    done = cli.invoke(app, ["bisect", a, str(runs["early"].path), "--floor", f"twin:{twin}", "--json"])
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.exit_code == 1 and got["first_step"] == 1 and got["floor_table"]["name"] == f"twin:{twin}", done.output
    done = cli.invoke(app, ["bisect", a, str(runs["late"].path), "--floor", f"twin:{twin}"])
    assert done.exit_code == 0, done.output
    other = _write(tmp_path / "other", {**MAXTEXT, "config": {"lr": 2e-3}}).path
    done = cli.invoke(app, ["bisect", a, str(runs["early"].path), "--floor", f"twin:{other}"])
    assert done.exit_code == 2 and done.stderr.count("\n") == 1 and "config is not run A's" in done.stderr, done.stderr
    done = cli.invoke(app, ["bisect", a, twin, "--floor", f"twin:{runs['same'].path}"])  # MaxText against MaxText
    assert done.exit_code == 2 and done.stderr.count("\n") == 1 and "--floor sets the noise floor" in done.stderr
