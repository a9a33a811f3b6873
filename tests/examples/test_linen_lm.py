"""examples/linen_lm.py (a Flax linen decoder-only LM, optax with gradient accumulation by
optax.MultiSteps, the batch sharded with a NamedSharding, a donated jitted step, a grain data
iterator checkpointed with the train state through the loop's own orbax CheckpointManager)
records, replays bit-exactly from a checkpoint, and bisect names injected bugs (the learning
rate's at the schedule's op inside MultiSteps' cond).
A replay whose iterator was not restored, or restored from a damaged state, is caught. (The
entering-state check of the NNX test is left out: the step is functional, nothing can alias its
input, and it would add ~3.5 s of compiles to a ~30 s module.)"""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli_util import invoke
from tests.examples import loops

import linen_lm  # noqa: E402  (importable: tests/examples/loops.py puts examples/ on the path)

import pytest  # noqa: E402

PARAM = "params.params.block_0.attn.query.kernel"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return loops.record_runs(linen_lm, tmp_path_factory.mktemp("linen"))


def test_lines_only_for_replay_are_few():
    assert 0 < len(loops.replay_lines(linen_lm)) <= 12, loops.replay_lines(linen_lm)


def test_the_batches_are_sharded_along_the_batch_axis_and_a_pure_function_of_the_position():
    import numpy as np
    from jax.sharding import NamedSharding

    cfg = linen_lm.Config()
    stream = iter(linen_lm.dataset(cfg))
    batches = [next(stream) for _ in range(5)]
    for x in batches[3].values():
        assert isinstance(x.sharding, NamedSharding) and x.sharding.spec[0] == "batch"
        assert x.shape == (cfg.batch, cfg.seq)
    resumed = iter(linen_lm.dataset(cfg))  # a fresh iterator set to the state after 3 batches
    position = iter(linen_lm.dataset(cfg))
    for _ in range(3):
        next(position)
    resumed.set_state(position.get_state())
    again = next(resumed)
    assert all(np.array_equal(batches[3][k], again[k]) for k in again)
    assert not np.array_equal(batches[3]["inputs"], batches[4]["inputs"])


def test_each_checkpoint_holds_the_iterator_state_in_the_same_orbax_step(runs):
    import json

    from traces import Run

    manifest = Run.open(runs["clean"]).manifest
    for k in (0, 10, 20, 30):  # a grain iterator: saved by grain's own handler, in its layout
        stored = json.loads((runs["clean"] / "checkpoints" / str(k) / "data" / "process_0-of-1.json").read_text())
        assert stored == {"next_index": k}, stored
        assert (runs["clean"] / "checkpoints" / str(k) / "state").is_dir()
    assert sorted(manifest["data_state_fingerprints"], key=int) == ["0", "10", "20", "30"]


def test_each_checkpoint_is_written_once_by_the_loops_own_manager_and_grain_restores_it(runs):
    """run.save wrote through the loop's CheckpointManager: replay records its folder and keeps no
    copy of its own (each orbax step folder exists once in the run), and the loop restores its
    iterator from a checkpoint with grain's handler, as it would to resume."""
    import orbax.checkpoint as ocp
    from grain import checkpoint as grain_checkpoint

    from traces import Run

    cfg, run = linen_lm.Config(), runs["clean"]
    assert Run.open(run).manifest["checkpoint_dir"] == "checkpoints"
    saved = sorted(p.parent.relative_to(run) for p in run.rglob("_CHECKPOINT_METADATA"))
    assert saved == [Path("checkpoints", str(k)) for k in (0, 10, 20, 30)], saved
    manager = linen_lm.checkpoint_manager(run / "checkpoints", cfg)
    assert manager.all_steps() == [0, 10, 20, 30]
    resumed = iter(linen_lm.dataset(cfg))
    manager.restore(10, args=ocp.args.Composite(data=grain_checkpoint.CheckpointRestore(resumed)))
    manager.close()
    assert (next(resumed)["inputs"] == linen_lm.batch_rows(cfg, 10)["inputs"]).all()


def test_the_state_and_taps_reach_the_record(runs):
    from traces import Run

    run = Run.open(runs["clean"])
    names = run.schema.tensor_names
    assert f"state/{PARAM}" in names and f"update/{PARAM}" in names
    assert any(n.startswith("grad/") for n in names)


def test_replay_is_bit_exact_from_a_checkpoint(runs):
    loops.check_replay_from_a_checkpoint(runs["clean"])


def test_replay_without_the_user_code_is_bit_exact(runs):
    loops.check_replay_without_code(runs["clean"])


def test_a_replay_against_another_trace_is_caught(runs, tmp_path):
    loops.check_replay_catches_another_trace(runs, tmp_path)


def test_bisect_names_the_learning_rate_change_as_update(runs):
    op = loops.check_bisect_lr(runs)["refinement"]["op"]
    # MultiSteps applies the update inside a lax.cond: the op named is the schedule's `eq` inside it (not
    # the cond), at the schedule's line in the example, called from optax's scale_by_learning_rate.
    line = next(i for i, text in enumerate(Path(linen_lm.__file__).read_text().splitlines(), 1)
                if "update == cfg.lr_bump_at" in text)
    assert [c["op"] for c in op["inside"]] == ["cond"] and "optax/" in op["inside"][0]["where"], op["inside"]
    assert op["user_frame"] == f"linen_lm.py:{line} (schedule.<locals>.<lambda>)", op
    assert op["library_frame"].startswith("optax/") and op["where"].startswith(op["user_frame"]), op


def test_bisect_names_a_refed_batch_as_data_and_where_it_was_first_fed(runs):
    loops.check_bisect_refeed(runs)


def test_bisect_of_identical_runs_exits_0(runs):
    loops.check_identical_runs(runs)


def test_a_replay_whose_iterator_is_not_restored_is_caught_as_data(runs, monkeypatch):
    """Had replay not restored the iterator state saved with checkpoint 10 (a fresh iterator, at
    batch 0): the run stored its rows, so the replay feeds those (bit-exact) and names the iterator
    that does not reproduce the run's stream; without stored rows it would be fed other batches,
    caught at step 10 as data, never reported bit-exact."""
    import replay.record.replayable as replayable
    from replay.record.data_iterator import IteratorFeed

    def fresh_instead(self, step):
        self._it, self.position, self._last = self.fresh(), step, None

    monkeypatch.setattr(IteratorFeed, "restore", fresh_instead)
    result = invoke("run", str(runs["clean"]), "--steps", "12:13", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["all_bit_exact"], result.output
    assert any("the loop's own data does not reproduce step 10's batch" in n and "set_state" in n
               for n in report["notes"]), report["notes"]
    monkeypatch.setattr(replayable, "_stored_rows", lambda run: None)  # as a run that stored no rows
    result = invoke("run", str(runs["clean"]), "--steps", "12:13", "--json")
    assert result.exit_code == 1, result.output
    first = json.loads(result.stdout)["first_mismatch"]
    assert first["step"] == 10 and first["fields"][0]["kind"] == "data", first


@pytest.mark.parametrize("damage", ["another position", "unreadable"])
def test_a_damaged_iterator_state_is_refused(runs, tmp_path, damage):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(runs["clean"], copy)
    stored = copy / "checkpoints" / "10" / "data" / "process_0-of-1.json"  # grain's layout
    text = stored.read_text()
    damaged = text.replace('"next_index": 10', '"next_index": 0') if damage == "another position" else text[:20]
    assert damaged != text
    stored.write_text(damaged)
    result = invoke("run", str(copy), "--steps", "12:13", "--json")
    assert result.exit_code == 2, result.output
    assert "data iterator state of checkpoint 10" in result.output, result.output


def test_compare_eval_of_identical_runs_agrees(runs):
    loops.check_compare_eval_of_identical_runs(runs)


def test_compare_eval_finds_the_learning_rate_change_at_the_next_checkpoint(runs):
    loops.check_compare_eval_finds_the_learning_rate_change(runs)


def test_compare_eval_of_a_loop_without_evaluate_names_the_field(runs, monkeypatch):
    loops.check_compare_eval_names_the_loop_field_to_add(runs, monkeypatch)


def test_spike_attributes_the_poisoned_example(runs):
    loops.check_spike_names_the_poisoned_example(runs, linen_lm.POISONED)
