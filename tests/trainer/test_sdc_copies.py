"""The in-training SDC re-run check (check.rerun_every, trainer/sdc.py) costs a step that is not
re-run one untaken branch, not a copy of the parameters: the branch reads the incoming params, and
unless the update is ordered after it XLA copies every donated parameter into its operands on every
step (measured ~4% of tiny's step at 8 devices; bench/sdc_overhead.py has the timing)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from trainer.config import apply_overrides
from trainer.presets import get_preset
from trainer.step import compile_step, init_state


def _copied_state_elements(cfg) -> tuple[int, int]:
    """(elements the compiled layer-level step copies out of its parameters, elements of the state)."""
    shape = (cfg.data.global_batch_size, cfg.model.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}
    state = jax.eval_shape(lambda: init_state(cfg))
    hlo = compile_step(cfg, "layer").lower(state, batch).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    assert " conditional(" in entry  # the re-run is a branch of this program
    params = set(re.findall(r"^\s*(%\S+) = \S+ parameter\(", entry, re.M))
    copied = sum(int(np.prod([int(d) for d in dims.split(",") if d]))
                 for dims, src in re.findall(r"= \w+\[([0-9,]*)\]\S* copy\((%[^)]+)\)", entry) if src in params)
    return copied, sum(x.size for x in jax.tree.leaves(state))


def test_the_rerun_check_does_not_copy_the_donated_parameters_every_step():
    # one device is enough: the copies come from the program's dataflow, not from the layout
    cfg = apply_overrides(get_preset("tiny"), ["mesh.mesh_invariant=true", "mesh.n_microbatches=4",
                                               "check.rerun_every=10", "model.n_layers=1"])
    copied, state_elements = _copied_state_elements(cfg)
    assert copied < 0.01 * state_elements, (copied, state_elements)
