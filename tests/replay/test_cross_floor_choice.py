"""Which noise floor judges a cross-framework pair (replay/bisect/cross_floor.py choose, `bisect --floor`),
on small synthetic traces: a MaxText-recorded run and an OLMo-core-recorded one whose rounding grows at a
rate between the trainer pair's table and the MaxText/OLMo-core pair's (measured by
bench/cross_noise_pair.py), so the table chosen decides the verdict."""

from __future__ import annotations

import json

import numpy as np
import pytest

from replay.bisect.cross import cross_bisect
from replay.bisect.cross_floor import OLMO3_PAIR, TRAINER, choose
from replay.errors import UserError
from tests.traces.helpers import drifting_run
from traces import Schema

W, STEPS = 16, 40
TENSORS = (("embeddings", "forward"), ("blocks.0.attention.w_q", "forward"))
SCHEMA = Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),), tensors=TENSORS, sketch_width=W)
MAXTEXT = {"loop": "maxtext", "environment": {"framework": "jax"}}
OLMO_CORE = {"recorded_by": "replay.torch", "olmo_core": {"fits": []}}


def _drift(k: int) -> float:
    """The relative distance at step k: half the geometric mean of the two tables' forward floors, so it
    is above the trainer's floor once the pair's has grown 4 x past it (step 1), and within the pair's."""
    return 0.5 * float(np.sqrt(TRAINER.at("forward", k) * OLMO3_PAIR.at("forward", k)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("floor_pair")
    return drifting_run(root / "mt", SCHEMA, MAXTEXT, STEPS), drifting_run(root / "oc", SCHEMA, OLMO_CORE, STEPS, _drift)


def test_auto_picks_the_pairs_own_table_only_for_maxtext_against_olmo_core():
    assert choose(None, MAXTEXT, OLMO_CORE) is OLMO3_PAIR and choose("auto", OLMO_CORE, MAXTEXT) is OLMO3_PAIR
    assert choose(None, {"environment": {"framework": "jax"}}, OLMO_CORE) is TRAINER  # the trainer vs OLMo-core
    assert choose(None, MAXTEXT, {"recorded_by": "replay.torch"}) is TRAINER  # a torch run not OLMo-core's
    assert choose("trainer", MAXTEXT, OLMO_CORE) is TRAINER


def test_the_table_chosen_decides_a_pair_drifting_between_the_two(pair):
    mt, oc = pair
    auto = cross_bisect(mt, oc)
    assert auto.noise is OLMO3_PAIR and auto.within_noise, auto.to_json()
    assert auto.to_json()["floor_table"]["name"] == "olmo3-pair" and 0.3 < auto.max_ratio < 1
    trainer = cross_bisect(mt, oc, floor="trainer")  # the same distances, judged by the trainer pair's table
    assert not trainer.within_noise and trainer.first_layer == "blocks.0.attention.w_q", trainer.to_json()
    assert trainer.first_step > 0 and trainer.to_json()["floor_table"]["name"] == "trainer"


def test_a_floor_file_is_read_and_bad_ones_are_one_line_errors(pair, tmp_path):
    mt, oc = pair
    f = tmp_path / "floor.json"
    f.write_text(json.dumps({"name": "mine", "base": dict(OLMO3_PAIR.base), "growth": dict(OLMO3_PAIR.growth)}))
    mine = cross_bisect(mt, oc, floor=str(f))
    assert mine.noise.name == "mine" and mine.within_noise and mine.max_ratio == cross_bisect(mt, oc).max_ratio
    f.write_text(json.dumps({"base": {"forward": 1e-9}, "growth": {"forward": 0.0}}))  # a far tighter one
    assert not cross_bisect(mt, oc, floor=str(f)).within_noise
    for text in ("{", json.dumps({"base": {"forward": 1e-6}}), json.dumps({"base": {"forward": 1}, "growth": {"x": 1}})):
        f.write_text(text)
        with pytest.raises(UserError) as e:
            choose(str(f), MAXTEXT, OLMO_CORE)
        assert e.value.exit_code == 2 and "\n" not in str(e.value)
    with pytest.raises(UserError, match="neither a floor's name"):
        choose("nonesuch", MAXTEXT, OLMO_CORE)


def test_the_cli_takes_floor_and_refuses_it_for_one_framework(pair, tmp_path):
    from typer.testing import CliRunner

    from replay.cli.app import app

    mt, oc = pair
    cli = CliRunner()
    done = cli.invoke(app, ["bisect", str(mt.path), str(oc.path)])
    assert done.exit_code == 0 and "olmo3-pair" in done.output, done.output
    done = cli.invoke(app, ["bisect", str(mt.path), str(oc.path), "--floor", "trainer", "--json"])
    assert done.exit_code == 1 and json.loads(done.stdout.strip().splitlines()[-1])["floor_table"]["name"] == "trainer"
    done = cli.invoke(app, ["bisect", str(mt.path), str(oc.path), "--floor", "nonesuch"])
    assert done.exit_code == 2 and done.stderr.count("\n") == 1 and "neither a floor's name" in done.stderr, done.stderr
    other = drifting_run(tmp_path / "mt2", SCHEMA, MAXTEXT, STEPS, _drift)
    done = cli.invoke(app, ["bisect", str(mt.path), str(other.path), "--floor", "trainer"])
    lines = done.stderr.strip().splitlines()
    assert done.exit_code == 2 and len(lines) == 1 and "--floor sets the noise floor of a bisect across" in lines[0]
