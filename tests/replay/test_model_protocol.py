"""The model side of the loop protocol: refine (replay/bisect/refine.py, replay/engine/recompute.py) and
`compare --eval` (replay/compare/sides.py) ask a run's replayable -- or, for a PyTorch run, a
plugin's `torch_reference(run)` -- for what they need, never the trainer.

Each test uses a replayable written here (a few tiny jnp ops) and runs written with the traces API
alone: nothing trains. Before issue 31, refine_step refused any run but the trainer's ("needs runs
of trainer/"), and compare --eval answered every other run with "not a trainer config".
"""

from __future__ import annotations

import ast
from importlib.metadata import EntryPoint
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import traces
from replay import plugins
from replay.bisect.refine import refine_step
from replay.record.names import get_path
from replay.engine.recompute import recomputes
from replay.engine.replayer import Replayer, ReplayUnavailable
from tests.cli_util import assert_one_line_error, invoke

ROOT = Path(__file__).resolve().parents[2]
STEPS, STEP = 4, 10  # refined at a step the trace does not hold: nothing to check it against
MODULES = ["replay/engine/recompute.py", "replay/bisect/refine.py", "replay/bisect/cross_distance.py",
           "replay/bisect/cross.py", "replay/bisect/cross_floor.py", "replay/bisect/first_op.py",
           "replay/compare/sides.py", "replay/compare/floor.py", "replay/compare/__init__.py",
           "replay/engine/tensor_distance.py", "replay/plugins.py", "replay/record/names.py"]


def _write(path: Path, manifest: dict) -> traces.Run:
    schema = traces.Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),))
    r = traces.Run.create(path, schema, manifest)
    w = r.writer(8)
    for k in range(STEPS):
        w.append(traces.StepRecord(k, np.array([k, 1], np.uint32), k + 1, np.arange(2 * k, 2 * k + 2, dtype=np.uint64),
                                   np.array([1.0], np.float32)))
    r.finish()
    (path / "checkpoints").mkdir(exist_ok=True)
    return traces.Run.open(path)


class Loop:
    """The required methods only: no capability."""

    def __init__(self, lr: float = 0.5):
        self.lr = lr

    def environment(self) -> dict:
        return {}

    def program_hash(self):
        return None

    def checkpoint_steps(self) -> list[int]:
        return [0]

    def restore(self, step: int):
        return {"params": {"dense": {"w": jnp.arange(1.0, 5.0)}}}

    def step(self, state, step: int):
        w = state["params"]["dense"]["w"]
        return ({"params": {"dense": {"w": w - self.lr * w}}}, {"loss": jnp.sum(w)},
                np.arange(2 * step, 2 * step + 2, dtype=np.uint64))


class Recomputation:
    """A StepRecomputation: a block (q, act, out) between an embedding and a head."""

    program = "the run's own"
    param_names = ["dense.w"]
    layer_names = ["embed", "block", "head"]
    block_names = ["block"]
    loss_names = ["loss"]

    def __init__(self, state, step: int, scale: float):
        self.state, self.step, self.scale = state, step, scale
        self.hashes = np.arange(2 * step, 2 * step + 2, dtype=np.uint64)

    def rng(self) -> np.ndarray:
        return np.array([self.step, 1], np.uint32)

    def params(self):
        return self.state["params"]

    def params_of(self, state):
        return state["params"]

    def opt_state(self):
        return {}

    def intermediate_names(self, block: str) -> list[str]:
        return [f"{block}.q", f"{block}.act", f"{block}.out"]

    def intermediates(self, block: str) -> dict:
        q = self.state["params"]["dense"]["w"] - 2.0
        act = jnp.maximum(q, 0.0) * self.scale  # `scale` != 1: a bug inside the block, after q
        return {"block.q": q, "block.act": act, "block.out": act * 2}

    def layers(self) -> dict:
        out = self.intermediates("block")["block.out"]
        return {"embed": self.state["params"]["dense"]["w"], "block": out, "head": jnp.sum(out)[None]}

    def loss_and_grads(self):
        return {"loss": jnp.sum(self.layers()["head"])}, {"dense": {"w": jnp.ones(4)}}

    def tensors(self, names, after) -> dict:
        return {}


class Recomputing(Loop):
    def __init__(self, lr: float = 0.5, scale: float = 1.0):
        super().__init__(lr)
        self.scale = scale

    def recompute_step(self, state, step: int) -> Recomputation:
        return Recomputation(state, step, self.scale)


def _replayers(tmp_path, a, b) -> tuple[Replayer, Replayer]:
    out = []
    for label, rep in (("A", a), ("B", b)):
        r = Replayer(label, _write(tmp_path / label, {"config": {}}))
        r._rep = rep
        out.append(r)
    return out[0], out[1]


def test_refine_names_the_first_intermediate_inside_a_block_of_any_loop_that_recomputes(tmp_path):
    ra, rb = _replayers(tmp_path, Recomputing(), Recomputing(scale=1.0 + 2 ** -10))
    assert recomputes(ra) and recomputes(rb)
    states = (ra.rep.restore(0), rb.rep.restore(0))
    out = refine_step(ra, rb, STEP, states)
    assert (out["cause"], out["layer"], out["first_intermediate"]) == ("forward", "block", "block.act"), out
    assert [c["field"] for c in out["chain"]] == ["state/params", "state/opt_state", "layers"]
    assert out["differing"] == 2 and out["distances"]["max_abs"] > 0  # relu left two of the four at 0
    assert out["programs"] == {"A": "the run's own", "B": "the run's own"}


def test_refine_reads_the_parameters_after_the_step_through_the_recomputation(tmp_path):
    ra, rb = _replayers(tmp_path, Recomputing(lr=0.5), Recomputing(lr=0.25))
    out = refine_step(ra, rb, STEP, (ra.rep.restore(0), rb.rep.restore(0)))
    assert (out["cause"], out["layer"], out["first_intermediate"]) == ("update", "param/dense.w", "dense.w"), out
    assert [c["equal"] for c in out["chain"]] == [True, True, True, True, True, False]


def test_a_loop_without_recompute_step_is_refused_in_one_line_naming_it(tmp_path):
    ra, rb = _replayers(tmp_path, Loop(), Recomputing())
    assert not recomputes(ra)
    with pytest.raises(ReplayUnavailable, match=r"does not provide recompute_step\(state, step\)"):
        refine_step(ra, rb, STEP, (ra.rep.restore(0), rb.rep.restore(0)))


def test_compare_eval_of_a_loop_without_evaluate_names_the_field_to_add(tmp_path, monkeypatch):
    a = _write(tmp_path / "a", {"config": {"steps": STEPS}, "replayable": "tests.replay.no_such_loop:factory"})
    b = _write(tmp_path / "b", {"config": {"steps": STEPS}, "replayable": "tests.replay.no_such_loop:factory"})
    monkeypatch.setattr("replay.engine.replayer.open_replayable", lambda run: Loop())
    result = invoke("compare", str(a.path), str(b.path), "--eval")
    assert_one_line_error(result, str(a.path), "evaluate(state, batch)", "replay.Loop(evaluate=...)")


def test_a_torch_run_no_plugin_knows_is_one_line_naming_the_hook(tmp_path):
    a = _write(tmp_path / "a", {"recorded_by": "replay.torch", "config": {"model": "not the trainer's"}})
    b = _write(tmp_path / "b", {"recorded_by": "replay.torch", "config": {"model": "not the trainer's"}})
    result = invoke("compare", str(a.path), str(b.path), "--eval")
    assert_one_line_error(result, str(a.path), "torch_reference(run)", "no installed replay plugin")


REFERENCE = object()


def torch_reference(run):  # this module as a plugin (below): it knows the runs tagged for it
    return REFERENCE if run.manifest.get("config", {}).get("tag") == "mine" else None


def test_the_reference_of_a_torch_run_comes_from_the_first_plugin_that_knows_it(tmp_path, monkeypatch):
    eps = (EntryPoint(name="a-trainer", value="trainer.plugin", group=plugins.GROUP),
           EntryPoint(name="b-tests", value=__name__, group=plugins.GROUP))
    monkeypatch.setattr(plugins, "_entry_points", eps)
    monkeypatch.setattr(plugins, "_loaded", {})
    mine = _write(tmp_path / "mine", {"recorded_by": "replay.torch", "config": {"tag": "mine"}})
    other = _write(tmp_path / "other", {"recorded_by": "replay.torch", "config": {"tag": "other"}})
    assert plugins.first_answer("torch_reference", mine) is REFERENCE  # the trainer's answers None first
    assert plugins.first_answer("torch_reference", other) is None
    assert plugins.first_answer("no_such_hook", mine) is None


def test_get_path_resolves_a_recorded_name_in_any_pytree():
    from typing import NamedTuple

    class State(NamedTuple):
        params: dict
        step: int

    tree = State({"block_00": {"attn": [np.zeros(1), np.ones(2)]}}, 3)
    assert get_path(tree, "params.block_00.attn.1").shape == (2,)
    assert get_path(tree, "step") == 3
    with pytest.raises(KeyError):
        get_path(tree, "params.block_01")


@pytest.mark.parametrize("path", MODULES)
def test_the_model_side_imports_nothing_from_the_trainer(path):
    tree = ast.parse((ROOT / path).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m == "trainer" or m.startswith("trainer.")], path
