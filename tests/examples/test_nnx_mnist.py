"""examples/nnx_mnist.py, the Flax NNX MNIST tutorial's loop as written (an in-place `@nnx.jit`
train_step of (model, optimizer, metrics, batch) returning nothing, BatchNorm, Dropout, an
nnx.MultiMetric reset every epoch, an epoch-shuffled iterator): `run.nnx_step` records it called
as written, replay is bit-exact from a checkpoint across epoch boundaries (with and without its
code), bisect names an injected learning-rate change and a re-fed batch, and a broken `make` is
refused while recording, in one line (issue 32's traps 1, 2 and 5)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from tests.cli_util import assert_one_line_error, invoke
from tests.examples import loops
from traces import Run

import nnx_mnist  # noqa: E402  (importable: tests/examples/loops.py puts examples/ on the path)
from flax import nnx  # noqa: E402

import replay  # noqa: E402
from replay.record.errors import RecordError  # noqa: E402


# The runs' config (their bugs aside). The tests that record a few steps of their own use it too:
# the schedule's length is a constant of the step program, so another `steps` is another compile.
FIXTURE_CONFIG = nnx_mnist.Config(steps=loops.STEPS, checkpoint_every=loops.EVERY)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return loops.record_runs(nnx_mnist, tmp_path_factory.mktemp("mnist"), names=("clean", "lr", "refeed"))


def test_lines_only_for_replay_are_few():
    assert 0 < len(loops.replay_lines(nnx_mnist)) <= 8, loops.replay_lines(nnx_mnist)


def _bits(tree) -> list[bytes]:
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x).tobytes()
            for x in jax.tree.leaves(tree)]


def test_the_recorded_step_leaves_the_callers_objects_as_nnx_jit_does(tmp_path):
    """Called as written, across a metrics.reset(): the model, optimizer and metrics end bit for bit
    where the unrecorded @nnx.jit step leaves them, the call returns what the step returns (None),
    and the trace's metrics are each step's own values (the loss of that batch, not the average)."""
    cfg = FIXTURE_CONFIG  # three of its steps are run: the recorded program is the fixture's, one compile
    plain, recorded = nnx_mnist.create(cfg), nnx_mnist.create(cfg)
    run = replay.init(tmp_path / "r", config=dataclasses.asdict(cfg), entrypoint=nnx_mnist.make)
    step = run.nnx_step(nnx_mnist.train_step)
    a, b, losses = nnx_mnist.Batches(cfg), nnx_mnist.Batches(cfg), []
    for k in range(3):
        nnx_mnist.train_step(*plain, next(a))
        losses.append(np.float32(plain[2].loss.compute()))
        assert step(*recorded, next(b)) is None
        assert _bits(nnx.state(plain)) == _bits(nnx.state(recorded))
        plain[2].reset(), recorded[2].reset()  # as the tutorial does every epoch
    run.finish()
    trace = Run.open(tmp_path / "r").trace  # metrics[0] is the loss: replay.record.program puts it first
    assert [np.float32(trace.read(k).metrics[0]).tobytes() for k in range(3)] == [x.tobytes() for x in losses]
    names = Run.open(tmp_path / "r").schema.tensor_names
    assert "state/0.norm.mean.value" in names and "update/1.opt_state.0.mu.conv.kernel.value" in names
    assert any(n.startswith("grad/") for n in names)  # a replay.tap inside the @nnx.jit step is recorded
    # The state is the model's (0) and the optimizer's (1) Variables; the metrics' totals (2) are not in it.
    assert {n.split("/", 1)[1].split(".")[0] for n in names if n.startswith(("state/", "update/"))} == {"0", "1"}


def test_replay_is_bit_exact_from_a_checkpoint_across_epochs_and_metric_resets(runs):
    loops.check_replay_from_a_checkpoint(runs["clean"])  # 10..25 crosses the epochs ending at 11 and 23


def test_replay_without_the_user_code_is_bit_exact(runs):
    loops.check_replay_without_code(runs["clean"])


def test_bisect_names_the_learning_rate_change_as_update(runs):
    loops.check_bisect_lr(runs)


def test_bisect_names_a_refed_batch_as_data_fed_five_steps_before(runs):
    """Every example is fed once an epoch, so the re-fed ones were also fed an epoch earlier: the
    step they were fed before in this epoch is among where bisect says it saw them."""
    result = invoke("bisect", str(runs["clean"]), str(runs["refeed"]), "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert (report["first_step"], report["cause"]) == (loops.REFEED_AT, "data"), report
    b = [e for e in report["examples"] if e["run"] == "B"]
    assert b and all(loops.REFEED_AT - 5 in {s["step"] for s in e["seen_before"] if s["run"] == "B"} for e in b), b


def test_audit_pack_and_a_bundle_replay(runs, tmp_path):
    """audit checks the epoch-shuffled order against the declared dataset size (each example once
    an epoch); a packed range replays bit for bit from the bundle, which never runs code."""
    result = invoke("audit", str(runs["clean"]), "--json")
    assert result.exit_code == 0, result.output
    bundle = tmp_path / "mnist.rpk"
    assert invoke("pack", str(runs["clean"]), "--steps", "12:15", "-o", str(bundle)).exit_code == 0
    result = invoke("run", str(bundle), "--steps", "12:15", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["all_bit_exact"] and report["replayed"] == report["bit_exact"] > 0, report


@replay.entrypoint
def wider_make(config: dict) -> replay.Loop:
    """A make with a bug: it builds a model of other sizes than the loop trains."""
    return nnx_mnist.make({**config, "features": config["features"] + 1})


@replay.entrypoint
def failing_make(config: dict) -> replay.Loop:
    return nnx_mnist.make({**config, "no_such_field": 1})


@pytest.mark.parametrize("make, needles", [
    (wider_make, ["test_nnx_mnist.wider_make", "leaf 0.conv.bias.value is float32[5] there, float32[4] here"]),
    (failing_make, ["test_nnx_mnist.failing_make", "TypeError", "no_such_field"]),
])
def test_a_broken_make_is_refused_at_the_first_step_in_one_line(tmp_path, make, needles):
    cfg = FIXTURE_CONFIG  # one step of it is run (refused): the fixture's program, not another compile
    nodes = nnx_mnist.create(cfg)
    run = replay.init(tmp_path / "r", config=dataclasses.asdict(cfg), entrypoint=make)
    step = run.nnx_step(nnx_mnist.train_step)
    with pytest.raises(RecordError) as e:
        step(*nodes, next(nnx_mnist.Batches(cfg)))
    run.close()
    message = str(e.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_an_nnx_step_called_otherwise_is_one_line(tmp_path):
    """Issue 32: run.step(train_step) called as the loop calls it was a raw TypeError."""
    model, optimizer, metrics = nnx_mnist.create(nnx_mnist.Config())
    run = replay.init(tmp_path / "a", config={}, entrypoint=nnx_mnist.make)
    with pytest.raises(RecordError, match=r"called with 4 arguments; .*use run.nnx_step\(fn\)"):
        run.step(nnx_mnist.train_step)(model, optimizer, metrics, {"image": 0})
    run.close()
    run = replay.init(tmp_path / "b", config={}, entrypoint=nnx_mnist.make)
    step = run.nnx_step(nnx_mnist.train_step)
    with pytest.raises(RecordError, match=r"fn\(\*graph nodes, batch\).*the batch last"):
        step(model, {"image": 0}, optimizer)
    run.close()


def test_a_loop_step_that_fails_at_replay_is_named_with_its_whole_message(runs, tmp_path, monkeypatch):
    """An error tracing the Loop's step at replay names the user's step, not replay's
    Program.compile, and keeps the lines after JAX's header line."""
    copy = tmp_path / "copy"  # a folder of its own: not the replayable other tests opened and cached
    shutil.copytree(runs["clean"], copy)

    def broken_step(model, optimizer, metrics, batch):
        raise ValueError("Mismatch details (1 found):\n  leaf conv.kernel: expected float32[3,3,1,4]")

    monkeypatch.setattr(nnx_mnist, "train_step", broken_step)
    result = invoke("run", str(copy), "--steps", "12:13", "--allow-code")
    line = assert_one_line_error(result, "broken_step (your code) raised ValueError: Mismatch details (1 found):",
                                 "leaf conv.kernel: expected float32[3,3,1,4]")
    assert "Program.compile" not in line, line


# ------------------------------------------------------------------------ names people know (human_names.py)

def test_the_nodes_are_named_in_run_json_and_shown_by_name(runs):
    from replay.engine.human_names import namer

    manifest = Run.open(runs["clean"]).manifest
    assert manifest["state_names"] == {"0": "model", "1": "optimizer"}
    shown = namer(manifest)
    assert shown("update/0.conv.kernel.value") == "update/model.conv.kernel"
    assert shown("state/1.opt_state.0.mu.conv.kernel.value") == "state/optimizer.opt_state.0.mu.conv.kernel"
    assert shown("grad/linear.bias.value") == "grad/linear.bias" and shown("loss") == "loss"


def test_bisect_tables_show_human_names_and_json_keeps_the_raw_ones(runs):
    result = invoke("bisect", str(runs["clean"]), str(runs["lr"]), "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 1, result.output
    raw = [f["name"] for f in report["fields"] if f["name"].startswith("update/")]
    assert raw and all(name.endswith(".value") and name.startswith(("update/0.", "update/1.")) for name in raw), raw
    text = invoke("bisect", str(runs["clean"]), str(runs["lr"])).stdout
    assert "update/model." in text and ".value" not in text and "update/0." not in text, text[-3000:]

