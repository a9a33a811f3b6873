"""What a user's loop gets wrong is the user's error, said in one line: an exception in their code
(exit 2, naming their function), a run without a `loss` metric for `spike`, tensors that are
not the schema's. And bisect refinement works on relative run paths and on states with typed
PRNG keys and leaves that are not arrays.

Runs are recorded from a copy of tests/replay/fixtures/tinyloop.py (legacy protocol).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replay.engine import code
from replay.engine.replayer import _copy, first_state_difference, state_fingerprints
from tests.cli_util import assert_error_line, invoke
from tests.replay.tinyruns import copy_loop, load_copy, record
from traces import Schema
from replay.record.recorder import RecordSchemaError, to_record


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_errors")
    loop = load_copy(copy_loop(root / "src"))
    out = root / "runs"
    named = {
        "plain": {}, "plain2": {}, "lr": {"lr": 0.2},
        "extras": {"extras": True}, "extras2": {"extras": True}, "extras_lr": {"extras": True, "lr": 0.2},
        "fail_factory": {"fail": "factory"}, "fail_restore": {"fail": "restore"}, "fail_step": {"fail": "step"},
        "fail_step_lr": {"fail": "step", "lr": 0.2},
        "mse": {"metric": "mse", "steps": 16},
    }
    return {"root": root, **{name: record(loop, out / name, **cfg) for name, cfg in named.items()}}


# ------------------------------------------------------------------ exceptions in user code

def _error_line(result, *needles: str) -> str:
    """Exit 2, and one `error:` line, the last on stderr (after the command's progress lines)."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    errors = [l for l in result.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("where, function, exc", [
    ("fail_factory", "tinyloop.replayable", "ValueError: tiny factory failed on purpose"),
    ("fail_restore", "tinyloop.TinyReplay.restore", "RuntimeError: tiny restore failed on purpose"),
    ("fail_step", "tinyloop.TinyReplay.step", "KeyError: 'tiny step failed on purpose'"),
])
def test_an_exception_in_user_code_is_exit_2_naming_the_function(runs, where, function, exc):
    """Old behaviour: "internal error, this is a bug in replay" (exit 3; exit 1 before issue 10)."""
    line = _error_line(invoke("run", str(runs[where]), "--steps", "1:3", "--allow-code"), function, exc, "tinyloop.py:")
    assert "bug in replay" not in line


def test_bisect_reports_an_exception_in_user_code_as_the_users(runs):
    result = invoke("bisect", str(runs["plain"]), str(runs["fail_step_lr"]), "--allow-code")
    _error_line(result, "tinyloop.TinyReplay.step", "KeyError")


def test_call_user_passes_replays_own_errors_through():
    from trainer.config import ConfigError

    def factory():
        raise ConfigError("a config problem")

    with pytest.raises(ConfigError):
        code.call_user(factory)
    with pytest.raises(code.UserCodeError, match=r"test_user_errors\..*<locals>\.boom.*ZeroDivisionError"):
        def boom():
            return 1 / 0

        code.call_user(boom)


# ------------------------------------------------------------------ bisect refinement inputs

def test_bisect_on_relative_run_paths(runs, monkeypatch):
    """Old behaviour: the factory got the relative path, and orbax refused it."""
    monkeypatch.chdir(runs["plain"].parent)
    result = invoke("bisect", "plain", "plain2", "--allow-code", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["method"] == "checkpoint comparison"
    result = invoke("bisect", "plain", "lr", "--allow-code", "--json")
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["first_step"] == 0


def test_bisect_on_states_with_typed_keys_and_leaves_that_are_not_arrays(runs):
    """Old behaviour: the device fingerprint of a typed key (and of a string) raised TypeError."""
    result = invoke("bisect", str(runs["extras"]), str(runs["extras2"]), "--allow-code", "--json")
    assert result.exit_code == 0, result.output
    result = invoke("bisect", str(runs["extras"]), str(runs["extras_lr"]), "--allow-code", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["first_step"] == 0 and report["method"] == "binary search by replay", report


def test_state_fingerprints_cover_every_kind_of_leaf():
    state = {"key": jax.random.key(0), "w": jnp.arange(3.0), "host": np.arange(2), "count": 3, "name": "x",
             "none": None, "f": 0.5}
    fa = state_fingerprints(state)
    assert [p for p, _ in fa] == ["count", "f", "host", "key", "name", "w"]
    for leaf, other in [("key", jax.random.key(1)), ("w", jnp.arange(3.0) + 1), ("host", np.arange(2) + 1),
                        ("count", 4), ("name", "y"), ("f", 0.25)]:
        assert first_state_difference(state, {**state, leaf: other}) == leaf
    assert first_state_difference(state, _copy(state)) is None
    assert first_state_difference({"n": 1}, {"n": 1.0}) == "n"  # same value, other type


# ------------------------------------------------------------------ spike needs a loss

def test_spike_without_a_loss_metric_names_the_metrics_and_metric_option(runs):
    """Old behaviour: a schema error from deep inside, no way to choose another metric."""
    line = assert_error_line(invoke("spike", str(runs["mse"]), "--window", "5"), 2, "'loss'", "mse", "--metric")
    assert_error_line(invoke("spike", str(runs["mse"]), "--step", "10", "--window", "5", "--allow-code"), 2, "mse",
                      "--metric")
    result = invoke("spike", str(runs["mse"]), "--window", "5", "--metric", "mse", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["window"] == 5
    assert_error_line(invoke("spike", str(runs["mse"]), "--metric", "nope"), 2, "'nope'", "mse")
    assert line


def test_spike_step_on_another_metric(runs):
    result = invoke("spike", str(runs["mse"]), "--step", "10", "--window", "5", "--metric", "mse", "--allow-code",
                    "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["step"] == 10


# ------------------------------------------------------------------ tensor names against the schema

SCHEMA = Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),),
                tensors=(("state/w", "state"), ("grad/w", "backward"), ("param/w", "update")))


def _metrics(**over) -> dict:
    base = {"loss": np.float32(1), "rng": np.zeros(2, np.uint32), "fingerprints": np.arange(6, dtype=np.uint32).reshape(3, 2),
            "rms": np.ones(3, np.float32)}
    return {**base, **over}


def test_tensor_names_in_schema_order_are_recorded():
    rec = to_record(SCHEMA, 0, _metrics(tensor_names=SCHEMA.tensor_names), np.zeros(2, np.uint64))
    assert len(rec.fingerprints) == 3
    by_name = {n: np.array([2 * i, 2 * i + 1], np.uint32) for i, n in enumerate(SCHEMA.tensor_names)}
    rms = {n: np.float32(i) for i, n in enumerate(SCHEMA.tensor_names)}
    rec2 = to_record(SCHEMA, 0, _metrics(fingerprints=dict(reversed(list(by_name.items()))), rms=rms),
                     np.zeros(2, np.uint64))
    assert np.array_equal(rec.fingerprints, rec2.fingerprints) and list(rec2.rms) == [0, 1, 2]


@pytest.mark.parametrize("names, words", [
    (("grad/w", "state/w", "param/w"), ["position 0", "'grad/w'", "'state/w'"]),  # swapped: same count
    (("state/w", "grad/w", "param/b"), ["position 2", "'param/b'"]),  # renamed
    (("state/w", "grad/w"), ["position 2", "nothing"]),  # one missing
])
def test_tensor_names_that_are_not_the_schemas_are_refused(names, words):
    """Old behaviour: only the count was (implicitly) checked; swapped names were filed as recorded."""
    with pytest.raises(RecordSchemaError) as e:
        to_record(SCHEMA, 5, _metrics(tensor_names=names), np.zeros(2, np.uint64))
    line = str(e.value)
    assert "\n" not in line and "step 5" in line
    for w in words:
        assert w in line, line


def test_tensors_by_name_and_count_are_checked():
    with pytest.raises(RecordSchemaError, match="param/b"):
        to_record(SCHEMA, 0, _metrics(fingerprints={"state/w": 1, "grad/w": 2, "param/b": 3}), np.zeros(2, np.uint64))
    with pytest.raises(RecordSchemaError, match="returned 2 fingerprints for the schema's 3"):
        to_record(SCHEMA, 0, _metrics(fingerprints=np.zeros((2, 2), np.uint32)), np.zeros(2, np.uint64))


def test_a_run_naming_no_loop_and_holding_no_trainer_config_cannot_be_replayed_here(tmp_path):
    """A run.json without `replayable` falls to the trainer's factory (runs from before replay.init);
    one that holds no trainer config either is a run replay cannot rebuild: one line, exit 2 (it was
    a KeyError: exit 3, "a bug in replay")."""
    from tests.traces.helpers import make_record, make_schema
    from traces import Run

    schema = make_schema(layer=False)
    for name, manifest in (("none", {}), ("null", {"config": None})):
        run = Run.create(tmp_path / name, schema, manifest)
        writer = run.writer()
        for step in range(3):
            writer.append(make_record(schema, step))
        run.finish()
        (tmp_path / name / "checkpoints" / "0").mkdir(parents=True)  # past the checkpoint check, to the factory
        assert_error_line(invoke("run", str(tmp_path / name), "--steps", "0:2"), 2,
                          "names no loop to replay it with", "holds no trainer config")
