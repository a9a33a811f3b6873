"""trainer/donation.py: the donated state written in place, read from the compiled HLO.

The trainer's step at every trace level (and in mesh-invariant mode) is reported in place; a
step that also returns its incoming parameters (so XLA must copy them before the update
overwrites them) is not: the check can fail. The parser is checked on a hand-written module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from trainer import donation, mesh as meshlib, step
from trainer.config import apply_overrides
from trainer.presets import get_preset
from trainer.constants import TRACE_LEVELS

# tiny's step at each level as the trainer's loop lowers it (trainer.mesh.lower_step), the program
# tests/trainer/test_step.py trains (tests/trainer/loop_programs.py) and, at level layer, every `tiny`
# run in the suite: the session's compilation cache (tests/conftest.py) compiles each once for all
CFG = get_preset("tiny")


def abstract(cfg):
    shape = (cfg.data.global_batch_size, cfg.model.seq_len)
    return meshlib.abstract_state(cfg), {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}


def params_bytes(cfg) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(meshlib.abstract_state(cfg).params))


@pytest.mark.parametrize("level", TRACE_LEVELS)
def test_the_train_step_writes_the_donated_state_in_place(level):
    state, _ = abstract(CFG)
    report = donation.check(meshlib.lower_step(CFG, level, meshlib.make_mesh(CFG.mesh))[0].compile())
    assert report["in_place"], report
    assert report["donated_leaves"] >= len(jax.tree.leaves(state)) - 1  # jit drops an unused leaf at most
    assert report["aliased_leaves"] == report["donated_leaves"]
    assert report["donated_bytes"] >= params_bytes(CFG) * 3  # params, mu, nu
    assert report["copied_bytes"] < 0.01 * report["donated_bytes"]  # the step's scalars at most


def test_the_mesh_invariant_step_writes_the_donated_state_in_place():
    # tests/trainer/test_forward_fingerprints.py's mesh-invariant config (one block: every kind of leaf
    # and of call site) at level layer, the one that reads the most, lowered as the loop lowers it:
    # that file's program (a step-level one with 4 microbatches was compiled for this test alone)
    from tests.trainer.test_forward_fingerprints import CONFIGS

    cfg = CONFIGS["mesh-invariant"]
    assert cfg.mesh.mesh_invariant and cfg.model.n_layers == 1
    assert donation.check(meshlib.lower_step(cfg, "layer", meshlib.make_mesh(cfg.mesh))[0].compile())["in_place"]


def test_a_step_that_copies_its_state_is_not_in_place():
    """Returning the incoming parameters beside the updated ones: XLA aliases the updated ones to
    the donated buffers and must copy the old values out first."""
    cfg = apply_overrides(CFG, ["model.n_layers=1"])  # every kind of leaf; a program of its own, so the smaller
    state, batch = abstract(cfg)

    def copying_step(state, batch):
        new, metrics = step.train_step(state, batch, cfg=cfg, level="step")
        return new, {**metrics, "params_before": state.params}

    report = donation.check(jax.jit(copying_step, donate_argnums=0).lower(state, batch).compile())
    assert not report["in_place"], report
    assert report["copied_bytes"] >= params_bytes(cfg)
    assert any("embedding" in name for name in report["copied"]), report["copied"]


def test_parsing_the_alias_table_and_the_copies():
    hlo = ("HloModule m, input_output_alias={ {0}: (0, {}, may-alias), {2}: (3, {}, must-alias) }, x=1\n"
           "\nENTRY %main (a: f32[4]) -> (f32[4]) {\n"
           '  %p0 = f32[4,8]{1,0} parameter(0), metadata={op_name="state.params[\\\'w\\\']"}\n'
           '  %p1 = bf16[16]{0} parameter(1), metadata={op_name="batch"}\n'
           '  %p3 = s32[] parameter(3), metadata={op_name="state.step"}\n'
           "  %copy.1 = f32[4,8]{1,0} copy(%p0)\n"
           "  %copy.2 = bf16[16]{0} copy(%p1)\n"
           "  ROOT %t = (f32[4,8]{1,0}) tuple(%copy.1)\n}\n")
    assert donation.aliases(hlo) == {0: "may-alias", 3: "must-alias"}
    assert donation.parameters(hlo)[0] == ("p0", "state.params['w']", 128)
    report = donation.check(hlo)
    assert report["donated_leaves"] == 2 and report["aliased_leaves"] == 2  # "batch" is not under "state"
    assert report["copied_bytes"] == 128 and report["copied"] == ["state.params['w']"] and not report["in_place"]
    assert donation.check(hlo.replace("copy(%p0)", "negate(%p0)"))["in_place"]
