"""`replay audit` on packed LM rows (issue 32): a loop that feeds windows of a token stream declares
its dataset in tokens (`replay.init(dataset_size=replay.Tokens(T))`); the audit takes epochs of
T // L rows (L: a row's tokens, recorded at the first step) and flags a row fed again inside one.
Without a declared size it counts no epochs at all (before: "over 1 epochs", taken from the
distinct rows the trace happened to hold)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replay
from tests.cli_util import invoke

B, L, STREAM = 4, 8, 4096  # rows of L tokens, B a step, windows of a STREAM-token corpus
TOKENS = STREAM  # one epoch is STREAM // L = 512 rows = 128 steps: every run here is inside epoch 0


def rows_at(step: int, refeed: tuple[int, int] | None = None) -> np.ndarray:
    """Step `step`'s B packed rows: consecutive L-token windows of the stream (the batch of step
    refeed[1] again at step refeed[0]: the loader bug)."""
    if refeed is not None and step == refeed[0]:
        step = refeed[1]
    stream = np.random.default_rng(1).integers(0, 100, STREAM, dtype=np.int32)
    return np.stack([stream[(step * B + j) * L:(step * B + j + 1) * L] for j in range(B)])


@jax.jit
def train_step(state: dict, tokens: jax.Array) -> tuple[dict, dict]:
    loss = jnp.mean((state["w"] * tokens.astype(jnp.float32)) ** 2)
    return {"w": state["w"] * 0.99}, {"loss": loss}


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    return replay.Loop(step=train_step, batch_at=lambda k: rows_at(k), init=lambda: {"w": jnp.float32(0.5)})


def _record(path, steps: int, dataset_size=None, refeed=None) -> None:
    run = replay.init(path, config={}, entrypoint=make, dataset_size=dataset_size)
    step = run.step(batch_axis=0)(train_step)
    state = {"w": jnp.float32(0.5)}
    run.save(0, state)
    for k in range(steps):
        state, _ = step(state, rows_at(k, refeed))
    run.finish()


def _audit(path) -> tuple[int, dict]:
    result = invoke("audit", str(path), "--json")
    return result.exit_code, json.loads(result.stdout)


def test_a_dataset_declared_in_tokens_gives_epochs_of_rows_and_finds_a_refed_window(tmp_path):
    _record(tmp_path / "clean", 12, replay.Tokens(TOKENS))
    manifest = json.loads((tmp_path / "clean" / "run.json").read_text())
    assert (manifest["dataset_tokens"], manifest["example_tokens"], manifest["dataset_size"]) == (TOKENS, L, None)
    code, clean = _audit(tmp_path / "clean")
    assert code == 0 and (clean["dataset_size"], clean["dataset_size_from"], clean["epochs"]) == (TOKENS // L, "tokens", 1)
    _record(tmp_path / "refed", 12, replay.Tokens(TOKENS), refeed=(9, 4))
    code, refed = _audit(tmp_path / "refed")
    assert code == 1 and refed["first_early_repeat_step"] == 9, refed
    assert refed["early_repeats"][0]["first_seen"] == [{"step": 4, "position": j} for j in range(B)]


def test_without_a_declared_size_no_epochs_are_counted(tmp_path):
    _record(tmp_path / "run", 12)
    code, report = _audit(tmp_path / "run")
    assert code == 0 and report["dataset_size_from"] == "trace" and report["epochs"] is None, report
    assert "epochs" not in report["summary"] and report["summary"].startswith(f"{12 * B} examples seen {12 * B} times")


def test_tokens_must_be_a_positive_count():
    with pytest.raises(replay.RecordError, match="number of tokens"):
        replay.Tokens(0)
