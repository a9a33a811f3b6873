"""Mesh-invariant mode (trainer/invariant.py): the pieces, checked in-process.

Whole runs (recorded on 8 and 4 devices and by 2 processes x 2 devices, replayed on 2 and 1,
without the fixed-order backward) are tests/trainer/test_invariant_claims.py's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replay.engine.contract import evaluate
from trainer import invariant
from trainer.config import ConfigError, apply_overrides
from trainer.presets import get_preset
from trainer.mesh import MeshError

def test_pair_tree_is_one_fixed_order():
    x = np.random.default_rng(0).standard_normal((11, 5)).astype(np.float32)

    def reference(rows):  # adjacent pairs per level, odd last carried up
        while len(rows) > 1:
            nxt = [rows[i] + rows[i + 1] for i in range(0, len(rows) - 1, 2)]
            rows = nxt + ([rows[-1]] if len(rows) % 2 else [])
        return rows[0]

    got = np.asarray(invariant.pair_tree(jnp.asarray(x)))
    assert got.tobytes() == reference(list(x)).tobytes()


@pytest.mark.parametrize("m,n", [(8, 1), (8, 2), (8, 4), (8, 8), (12, 3), (12, 2), (6, 6), (24, 4)])
def test_local_subtrees_then_gathered_tree_equal_the_global_tree(m, n):
    """What each device does (its aligned complete subtrees, then the tree over everyone's
    partial sums in global order) adds the same pairs in the same order as one device."""
    x = jnp.asarray(np.random.default_rng(m * n).standard_normal((m, 7)).astype(np.float32) * 1e3)
    local = m // n
    levels = invariant._aligned_levels(local)
    partials = jnp.concatenate([invariant.pair_tree(x[d * local:(d + 1) * local], levels) for d in range(n)])
    assert np.asarray(invariant.pair_tree(partials)).tobytes() == np.asarray(invariant.pair_tree(x)).tobytes()


def test_microbatch_checks_are_one_line():
    cfg = apply_overrides(get_preset("tiny"), ["mesh.mesh_invariant=true", "mesh.n_microbatches=8"])
    invariant.check(cfg, 8)
    with pytest.raises(MeshError, match="not a multiple of the 3 devices"):
        invariant.check(cfg, 3)
    bad = apply_overrides(get_preset("tiny"), ["mesh.mesh_invariant=true", "mesh.n_microbatches=5"])
    with pytest.raises(MeshError, match="does not divide data.global_batch_size=16"):
        invariant.check(bad, 1)


def test_invariant_counts_only_where_measured():
    cfg = apply_overrides(get_preset("tiny"), ["mesh.mesh_invariant=true", "mesh.n_microbatches=4"])
    assert invariant.invariant_counts(cfg, "gpu", 1) == []  # never measured there
    assert invariant.invariant_counts(cfg, "cpu", 16) == []  # the pool grows past the pinned size
    if invariant.settings_problem() is None:  # this pytest process was started with the settings
        assert invariant.invariant_counts(cfg, "cpu", 1) == [1, 2, 4]  # 8 devices cannot hold 4 microbatches
    else:
        assert invariant.invariant_counts(cfg, "cpu", 1) == []


def test_a_process_started_without_the_settings_is_refused():
    jax.devices()  # the backend is running, as XLA_FLAGS and PJRT_NPROC had it
    if invariant.settings_problem() is None:
        pytest.skip("this process was started with mesh-invariant settings")
    with pytest.raises(ConfigError, match="mesh-invariant mode needs XLA_FLAGS=--xla_cpu_max_isa=AVX"):
        invariant.prepare_process()


def test_contract_for_mesh_invariant_runs():
    env = {"backend": "cpu", "device_kind": "cpu", "device_count": 4, "process_count": 1, "cpu_count": 2,
           "xla_flags": f"--xla_force_host_platform_device_count=4 {invariant.ISA_FLAG}", "versions": {"jax": "1"},
           "random": {}}
    one = {**env, "device_count": 1, "xla_flags": invariant.ISA_FLAG}
    assert evaluate(env, one, "a", "b", True, (1, 2, 4, 8)).expect_bits
    assert not evaluate(env, one, "a", "b", False, (1, 2, 4, 8)).expect_bits  # not a mesh-invariant run
    assert not evaluate(env, one, "a", "b", True, (2, 4, 8)).expect_bits  # 1 not measured
    assert not evaluate(env, one, "a", "b", True, (1, 2)).expect_bits  # the recording's 4 not measured
    other_flags = {**one, "xla_flags": ""}  # a flag besides the device count changed
    c = evaluate(env, other_flags, "a", "b", True, (1, 2, 4, 8))
    assert not c.expect_bits and c.line.startswith("measured only")


def test_fixed_order_backward_keeps_forward_bits_and_gradients_close():
    """softmax and RMSNorm with fixed_backward=True: the same forward bits, gradients
    within float rounding of autodiff's (the sums are only reordered)."""
    from trainer import model, step

    cfg = apply_overrides(get_preset("tiny"), ["model.n_layers=1"])  # both kinds of call site; compiles faster
    params = model.init_params(cfg.model, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, cfg.model.seq_len)), jnp.int32)

    def run(fixed_backward: bool):
        loss_fn = functools.partial(step.loss_fn, fixed_backward=fixed_backward)
        return jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(1, 5))(
            params, cfg, tokens, tokens, None, False)

    (loss_a, _), grads_a = run(False)
    (loss_b, _), grads_b = run(True)
    assert np.asarray(loss_a).tobytes() == np.asarray(loss_b).tobytes()
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_sharded_norm_is_the_fixed_order_norm_in_float32():
    """param_norm's norm (tree_sums.sharded_norm) on one device: fixed_order_sums' bits over the leaves
    taken whole, bfloat16 leaves squared in float32, near the float64 norm; the multi-device bits are
    tests/trainer/test_invariant_claims.py's (step-level runs on 1 and 4 devices)."""
    from trainer import tree_sums

    rng = np.random.default_rng(3)
    tree = {"w": jnp.asarray(rng.standard_normal((6, 4, 3)), jnp.float32), "s": jnp.float32(1.5),
            "b": jnp.asarray(rng.standard_normal(300) * 50, jnp.bfloat16)}
    leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(tree)]
    expected, _ = tree_sums.fixed_order_sums(leaves, [False] * len(leaves), None)
    got = jax.jit(lambda t: tree_sums.sharded_norm(t, invariant.mesh_or_one_device(None)))(tree)
    assert got.dtype == jnp.float32 and np.asarray(got).tobytes() == np.asarray(expected).tobytes()
    exact = np.sqrt(sum((np.asarray(x, np.float64) ** 2).sum() for x in leaves))
    assert abs(float(got) - exact) <= 1e-6 * exact
