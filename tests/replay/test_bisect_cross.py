"""`replay bisect TORCH_RUN JAX_RUN`: the cross-framework bisect on short pairs (tiny preset, fp32).

The reference (replay.torch, trainer/reference_train.py) and the JAX trainer from the same
weights on the same batches, and a JAX run with RMSNorm epsilon 1e-5 (the reference's is 1e-6),
are session-shared runs (tests/torch/reference_pair.py: the reference of `replay demo --reference
torch --steps 8`, JAX runs on its config recorded without distance sketches, so bisect replays
them, as it does the trainer's default runs); a module fixture trains the runs that break one
input: a torch run from other weights, a JAX run on other data.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from replay.bisect import bisect  # noqa: E402
from replay.bisect.cross import CrossReport, DENSE_STEPS, _examined  # noqa: E402
from tests.cli_util import invoke, last_json  # noqa: E402
from tests.torch.reference_pair import DEMO_STEPS, demo, demo_config, one_torch_thread, port_run  # noqa: E402
from traces import Run  # noqa: E402
from trainer.reference_train import reference_rows, train_reference  # noqa: E402

READS_SHARED_RUNS = True  # tests/conftest.py orders this file after the one that makes them
STEPS = DEMO_STEPS
CFG = demo_config()
INPUT_STEPS = 2  # the runs that break an input: bisect stops at the input check of step 0


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The reference's training and re-runs on one thread (tests/torch/reference_pair.py)."""
    with one_torch_thread():
        yield


def _jax(path, cfg=CFG):
    from trainer.loop import train

    train(cfg, path)
    return path


@pytest.fixture(scope="module")
def runs():
    jax, eps = port_run(None, sketches=False), port_run("norm_eps", sketches=False)
    assert Run.open(eps).manifest["config"]["model"]["norm_eps"] == 1e-5 and CFG.model.norm_eps == 1e-6
    assert Run.open(jax).schema.sketch_width == Run.open(eps).schema.sketch_width == 0  # bisect replays them
    return {"torch": demo()["reference"], "jax": jax, "jax_eps": eps}


@pytest.fixture(scope="module")
def input_runs(runs, tmp_path_factory):
    from trainer import model, rng

    d = tmp_path_factory.mktemp("cross_inputs")
    short = dataclasses.replace(CFG, steps=INPUT_STEPS, trace=dataclasses.replace(CFG.trace, sketches=False))
    other_weights = model.init_params(CFG.model, rng.init_key(7))
    return {**runs, "torch_other_init": train_reference(short, d / "torch_init", INPUT_STEPS, start_params=other_weights),
            "jax_other_data": _jax(d / "jax_data", dataclasses.replace(short, seed=1))}


def _open(runs, *names):
    return [Run.open(runs[n]) for n in names]


def test_the_reference_is_fed_the_trainers_batches_and_weights(runs):
    t, j = _open(runs, "torch", "jax")
    for k in range(STEPS):
        np.testing.assert_array_equal(t.trace.read(k).example_hashes, j.trace.read(k).example_hashes)
    i = t.schema.tensor_names.index("state/params")
    assert t.trace.read(0).fingerprints[i] == j.trace.read(0).fingerprints[j.schema.tensor_names.index("state/params")]
    assert reference_rows(CFG, 0).shape == (CFG.data.global_batch_size, CFG.model.seq_len + 1)


@pytest.fixture(scope="module")
def clean(runs):
    return bisect(*_open(runs, "torch", "jax"))


def test_a_clean_pair_agrees_within_the_noise_floor_at_every_step(clean):
    report = clean
    assert isinstance(report, CrossReport) and report.torch_side == "A"
    assert report.within_noise and report.first_step is None and report.cause is None, report.to_json()
    assert sorted(report.distances) == list(range(STEPS)) and report.source == "replay"
    assert report.inputs["data"]["equal"] and report.inputs["init"]["equal"]
    # Real distances were measured (rounding noise, not zeros), and are below the floor.
    forward = [report.distances[0][n] for n, k in report.names if k == "forward" and n != "embed"]
    assert all(0 < d < 1e-4 for d in forward)
    assert 0 < report.max_ratio < 1


def test_an_rmsnorm_epsilon_port_bug_is_found_at_step_0_in_the_first_normed_layer(runs, tmp_path):
    # JAX run first: either order is a cross-framework bisect.
    bad = invoke("bisect", str(runs["jax_eps"]), str(runs["torch"]), "--json", "--plot", str(tmp_path / "h.png"))
    assert bad.exit_code == 1, bad.output
    report = last_json(bad)
    assert report["torch_side"] == "B" and not report["within_noise"]
    assert (report["first_step"], report["first_layer"], report["cause"]) == (0, "block_00.attn", "forward")
    assert report["cause_text"].startswith("forward layer block_00.attn") and report["ratio"] > 100
    assert report["first_op"] == "block_00.attn.q_norm"  # the first norm inside it (tests/torch/test_port_ops.py)
    assert report["distances"]["0"]["embed"] == 0  # the embedding precedes every norm: equal bits
    assert (tmp_path / "h.png").stat().st_size > 10_000


@pytest.mark.slow  # two more trainings
def test_other_weights_are_the_init_and_other_data_is_data(input_runs):
    runs = input_runs
    t, j = _open(runs, "torch_other_init", "jax")
    report = bisect(t, j)
    assert (report.first_step, report.cause, report.first_layer) == (0, "init", "state/params")
    assert report.inputs["init"]["equal"] is False and not report.distances  # nothing judged after an input
    t, j = _open(runs, "torch", "jax_other_data")
    report = bisect(t, j)
    assert (report.first_step, report.cause) == (0, "data") and report.inputs["data"]["positions"]


def test_the_cli_says_a_clean_pair_agrees_and_exits_0(runs):
    ok = invoke("bisect", str(runs["torch"]), str(runs["jax"]))
    assert ok.exit_code == 0, ok.output
    assert "agree within the noise floor at every examined step" in ok.stdout


def test_a_long_pair_examines_a_bounded_number_of_steps():
    steps = _examined(0, 1_000_000)
    assert len(steps) <= DENSE_STEPS and steps[0] == 0 and steps[-1] == 999_999
    assert _examined(5, 9) == [5, 6, 7, 8]


def test_a_report_is_json_and_names_the_same_fields_as_a_same_framework_report(runs, clean):
    json.dumps(clean.to_json(), allow_nan=False)
    same = bisect(*_open(runs, "jax", "jax"), refine=False)  # the same-framework path, unchanged
    assert not isinstance(same, CrossReport) and same.within_noise and same.first_layer is None


@pytest.mark.slow  # one more training (8 steps, its own programs)
def test_a_port_sketched_every_2_steps_is_searched_by_replay_between_its_sketched_steps(tmp_path, monkeypatch):
    """AdamW's epsilon acts first at step 1 (the warmup's learning rate is 0 at step 0). A JAX port
    recording the layer level, sketches included, every 2 steps (trace.layer_every=2) holds no sketch
    at step 1: from its trace alone the changed update first shows at step 2, in the forward layers fed
    the changed weights. The bisect reads the sketched steps, finds step 2 above, replays step 1 (the
    one step between) and names the update there, as the port-bug table does for a port sketched at
    every step (tests/torch/test_port_bugs.py)."""
    import replay.bisect.cross_distance as cross_distance
    from trainer.port_bugs import PORT_BUGS, with_bug

    cfg = with_bug(CFG, "adam_eps")
    cfg = dataclasses.replace(cfg, trace=dataclasses.replace(cfg.trace, layer_every=2))
    t, j = Run.open(demo()["reference"]), Run.open(_jax(tmp_path / "jax", cfg))
    assert j.schema.sketch_width == t.schema.sketch_width > 0 and j.trace.read(1).sketches is None
    tensor = PORT_BUGS["adam_eps"].first_tensor
    traced = dict(cross_distance.from_traces(t, j, [1, 2], cross_distance.compared_names(t, j)))
    assert tensor not in traced[1] and tensor in traced[2]  # what the traces alone can see

    replayed, real = [], cross_distance.from_replay

    def spy(torch_run, jax_run, steps, names, **kw):
        replayed.append(list(steps))
        return real(torch_run, jax_run, steps, names, **kw)

    monkeypatch.setattr(cross_distance, "from_replay", spy)
    report = bisect(t, j)
    assert (report.first_step, report.first_layer, report.cause) == (1, tensor, "update"), report.to_json()
    assert report.source == "traces+replay" and replayed == [[1]], (report.source, replayed)
    assert sorted(report.distances) == [0, 1, 2]
    assert report.distances[2][tensor] > report.noise.at("update", 2)  # step 2 was above too: 1 is the first


def test_sampled_steps_of_a_replayed_pair_start_from_the_jax_runs_checkpoints(runs, monkeypatch):
    """Beyond DENSE_STEPS the steps examined are samples; replayed, each moves back to the JAX run's
    newest checkpoint at or before it and starts there, so a long pair costs a restore and one step a
    sample, not a replay of every step up to the last one. Here with DENSE_STEPS 3 on the 8-step pair
    (checkpoints every 2 steps): samples 0, 4, 7 are examined as 0, 4, 6 and the last step 7, from
    checkpoints 0, 4 and 6 and no step replayed in between (before: one restore and steps 1-3 and 5 replayed)."""
    import replay.bisect.cross as cross
    from replay.engine.replayer import Replayer

    monkeypatch.setattr(cross, "DENSE_STEPS", 3)
    restores, advanced = [], []
    real_restore, real_advance = Replayer.restore, Replayer.advance

    def restore(self, k):
        restores.append(k)
        return real_restore(self, k)

    def advance(self, state, start, stop, keep_input=True):
        advanced.extend(range(start, stop))
        return real_advance(self, state, start, stop, keep_input)

    monkeypatch.setattr(Replayer, "restore", restore)
    monkeypatch.setattr(Replayer, "advance", advance)
    report = bisect(*_open(runs, "torch", "jax"))
    assert report.source == "replay" and report.within_noise, report.to_json()
    assert sorted(report.distances) == [0, 4, 6, 7]
    assert restores == [0, 4, 6] and advanced == [], (restores, advanced)
