"""What README.md and trainer/invariant.py promise of mesh-invariant mode, checked bit for bit.

tests/trainer/test_invariant.py replays a 4-device recording on 2 and 1 devices; this module
adds the rest of the promised set: a run recorded on 8 devices, and one recorded by 2 processes
x 2 devices, against the same run on 1 device, compared in every stored byte of every trace
record (metrics, per-example losses, RNG words, hashes, every fingerprint and RMS) and in every
array of every checkpoint. The comparison is shown to fail on a real difference: without the
fixed-order backward (trainer/model.py, `fixed_order_backward`) 1 and 8 devices part at step 0
in the gradients, which is also why a run that silently fell back to autodiff's backward would
not equal the recorded ones.

The fast tests show in-process that the mesh-invariant step runs every softmax and RMSNorm
backward through the fixed-order VJPs, and that the gradients are made of what those VJPs
compute (another summation order, as correct, gives other gradient bits).
"""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.trainer.test_invariant import INVARIANT, ROOT, cli, sets
from tests.trainer.test_train_e2e import env, free_port, replay_cmd
from traces import Run, compare
from trainer import invariant, model, step as steplib
from trainer.config import apply_overrides, from_dict, get_preset

STEPS, EVERY = 4, 2  # checkpoints 0, 2 and 4: states compared mid-run and at the end
RUN_SETS = INVARIANT + [f"steps={STEPS}", f"checkpoint.every_steps={EVERY}"]
# The same CLI with model.fixed_order_backward replaced by a no-op: autodiff's backward inside
# the microbatch scheme, everything else (scheme, process settings) as mesh-invariant mode has it.
WITHOUT_FIXED_BACKWARD = ("import contextlib; from trainer import model; "
                          "model.fixed_order_backward = contextlib.nullcontext; "
                          "from replay.cli.app import main; main()")


# ------------------------------------------------------------------------------ comparing runs

@functools.lru_cache(maxsize=None)  # the 1-device runs are each compared with several others
def _checkpoint_leaves(path: Path, step: int) -> list[tuple[str, bytes]]:
    """Every array of checkpoint `step`, restored on this process's one device, as raw bytes."""
    from trainer import mesh as meshlib
    from trainer.checkpoint import Checkpointer

    cfg = from_dict(Run.open(path).manifest["config"])
    target = meshlib.sharded_abstract_state(cfg, meshlib.make_mesh(cfg.mesh))
    state = Checkpointer(path / "checkpoints", create=False).restore(step, target)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return [(jax.tree_util.keystr(p), np.asarray(x).tobytes()) for p, x in flat]


def differences(a: Path, b: Path) -> list[str]:
    """Where two runs' recorded bits differ: trace fields (compare's causal order), stored record
    bytes, checkpoint arrays. [] means every byte checked is equal."""
    ra, rb = Run.open(a), Run.open(b)
    out = []
    if (ra.trace.start, ra.trace.end) != (rb.trace.start, rb.trace.end) or ra.trace.end != STEPS:
        return [f"trace ranges {ra.trace.start}..{ra.trace.end} and {rb.trace.start}..{rb.trace.end}"]
    result = compare(ra.trace, rb.trace)
    if not result.identical:
        out += [f"step {result.first_step} {d.kind} {d.name}" for d in result.diffs]
    out += [f"step {k} record bytes" for k in range(STEPS) if ra.trace.raw_frame(k) != rb.trace.raw_frame(k)]
    if ra.manifest["checkpoints"] != rb.manifest["checkpoints"]:
        return out + [f"checkpoints {ra.manifest['checkpoints']} vs {rb.manifest['checkpoints']}"]
    for k in ra.manifest["checkpoints"]:
        la, lb = _checkpoint_leaves(a, k), _checkpoint_leaves(b, k)
        out += [f"checkpoint {k} {na}" for (na, xa), (_, xb) in zip(la, lb) if xa != xb]
    return out


# ------------------------------------------------------------------------------ runs (slow)

def _train(devices: int, path: Path, *prefix: str) -> Path:
    if prefix:
        cmd = [sys.executable, *prefix, "train", "--preset", "tiny", "--out", str(path), *sets(RUN_SETS)]
        done = subprocess.run(cmd, cwd=ROOT, env=env(devices), capture_output=True, text=True, timeout=300)
    else:
        done = cli(devices, "train", "--preset", "tiny", "--out", str(path), *sets(RUN_SETS))
    assert done.returncode == 0, done.stderr[-2000:]
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(name) -> path, trained on first use: "1" and "8" devices in mesh-invariant mode,
    "2x2" (2 processes x 2 devices), and "fallback-1" / "fallback-8" without the fixed-order backward."""
    root = tmp_path_factory.mktemp("invariant-claims")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            path = root / name
            if name in ("1", "8"):
                _train(int(name), path)
            elif name == "2x2":
                port = free_port()
                procs = [subprocess.Popen(replay_cmd("train", "--preset", "tiny", "--out", str(path), *sets(RUN_SETS),
                                                     "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                                     "--process-id", str(i)),
                                          cwd=ROOT, env=env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                         for i in range(2)]
                outs = [p.communicate(timeout=300) for p in procs]
                assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
            else:
                _train(int(name.split("-")[1]), path, "-c", WITHOUT_FIXED_BACKWARD)
            made[name] = path
        return made[name]

    return get


def manifest(path: Path) -> dict:
    return json.loads((path / "run.json").read_text())


@pytest.mark.slow
def test_eight_devices_record_the_bits_of_one(runs):
    one, eight = runs("1"), runs("8")
    env8 = manifest(eight)["environment"]
    assert (env8["device_count"], env8["process_count"]) == (8, 1)
    assert 8 in manifest(eight)["invariant_device_counts"] and 1 in manifest(one)["invariant_device_counts"]
    assert differences(one, eight) == []


@pytest.mark.slow
def test_two_processes_of_two_devices_record_the_bits_of_one(runs):
    one, multi = runs("1"), runs("2x2")
    env4 = manifest(multi)["environment"]
    assert (env4["device_count"], env4["process_count"]) == (4, 2)
    assert Run.open(multi).status == "complete"
    assert differences(one, multi) == []


@pytest.mark.slow
def test_without_the_fixed_order_backward_one_and_eight_devices_differ(runs):
    """The same comparison fails on a real difference: autodiff's softmax/RMSNorm backward sums
    in an order XLA:CPU picks per program, so 1 and 8 devices part in the gradients at step 0."""
    found = differences(runs("fallback-1"), runs("fallback-8"))
    assert found and found[0].startswith("step 0 backward grad/"), found[:3]
    assert not any(f.startswith("step 0 forward") or f.startswith("step 0 loss") for f in found)


@pytest.mark.slow
def test_mesh_invariant_runs_used_the_fixed_order_backward(runs):
    """A mesh-invariant run that fell back to autodiff's backward would equal fallback-1 bit for
    bit; the recorded run's gradients differ from it (and its forward pass does not)."""
    found = differences(runs("1"), runs("fallback-1"))
    assert found and found[0].startswith("step 0 backward grad/"), found[:3]
    assert not any(f.startswith("step 0 forward") or f.startswith("step 0 loss") for f in found)
    assert any(f.startswith(f"checkpoint {EVERY} ") for f in found)  # the states compared differ too


# ------------------------------------------------------------------------------ fast: in-process

CFG = apply_overrides(get_preset("tiny"), INVARIANT)


def _batch(cfg) -> dict:
    shape = (cfg.data.global_batch_size, cfg.model.seq_len)
    tokens = np.random.default_rng(5).integers(0, cfg.model.vocab_size, (shape[0], shape[1] + 1))
    return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


def _vjps(softmax_bwd, rms_bwd):
    """Stand-ins for model._softmax_fixed and model._rms_norm_fixed: the same forward and
    residuals, the given backward functions."""
    softmax = jax.custom_vjp(model._softmax)
    softmax.defvjp(model._softmax_fixed_fwd, softmax_bwd)
    rms = jax.custom_vjp(lambda x, s, eps: model._rms_norm(x, s, eps)[0], nondiff_argnums=(2,))
    rms.defvjp(model._rms_norm_fixed_fwd, rms_bwd)
    return softmax, rms


@contextlib.contextmanager
def _patched_vjps(monkeypatch, softmax_bwd, rms_bwd):
    softmax, rms = _vjps(softmax_bwd, rms_bwd)
    with monkeypatch.context() as m:
        m.setattr(model, "_softmax_fixed", softmax)
        m.setattr(model, "_rms_norm_fixed", rms)
        yield


def test_every_softmax_and_rmsnorm_backward_of_the_step_is_the_fixed_order_one(monkeypatch):
    calls = {"softmax": 0, "rms": 0}

    def softmax_bwd(res, g):
        calls["softmax"] += 1
        return model._softmax_fixed_bwd(res, g)

    def rms_bwd(eps, res, g):
        calls["rms"] += 1
        return model._rms_norm_fixed_bwd(eps, res, g)

    state = jax.eval_shape(lambda: steplib.init_state(CFG))
    m = CFG.model
    norms_per_block = 2 + (2 if m.qk_norm else 0)  # attn_norm, mlp_norm (+ q_norm, k_norm)
    with _patched_vjps(monkeypatch, softmax_bwd, rms_bwd):
        jax.make_jaxpr(functools.partial(steplib.train_step, cfg=CFG, level="layer"))(state, _batch(CFG))
        # Traced once (the scan body is one microbatch): one backward per call site in the model.
        assert calls == {"softmax": m.n_layers, "rms": m.n_layers * norms_per_block + 1}
        plain = apply_overrides(get_preset("tiny"), [])
        jax.make_jaxpr(functools.partial(steplib.train_step, cfg=plain, level="layer"))(state, _batch(plain))
        assert calls == {"softmax": m.n_layers, "rms": m.n_layers * norms_per_block + 1}  # plain: autodiff's


@pytest.mark.slow  # two ~6 s compiles of the microbatched gradient
def test_the_gradients_are_made_of_the_fixed_order_backward(monkeypatch):
    """Another summation order inside the same VJPs, as correct, changes the gradient bits and
    not the loss: what the step's gradients hold is what those VJPs compute."""

    def reversed_sum(x):  # the same sum over the last axis, added up in another order
        return model.tree_sum(x[..., ::-1])

    def softmax_bwd(p, g):
        return ((g - reversed_sum(g * p)) * p,)

    def rms_bwd(eps, res, g):
        x32, scale32, rms = res
        gs = g * scale32
        dx = gs * rms - x32 * (rms * rms * rms) * (reversed_sum(gs * x32) / x32.shape[-1])
        return dx, reversed_sum((g * x32 * rms).reshape(-1, x32.shape[-1]).T)[:, 0]

    cfg = apply_overrides(CFG, ["model.n_layers=1"])  # one block has every kind of call site; compiles faster
    state = steplib.init_state(cfg)
    key = jax.random.key(3, impl="threefry2x32")

    def grads():
        fn = jax.jit(lambda p, b: invariant.value_and_grad(p, cfg, b, key, False, None))
        (loss, _), g = fn(state.params, _batch(cfg))
        return np.asarray(loss), [np.asarray(x) for x in jax.tree.leaves(g)]

    loss_a, grads_a = grads()
    with _patched_vjps(monkeypatch, softmax_bwd, rms_bwd):
        loss_b, grads_b = grads()
    assert loss_a.tobytes() == loss_b.tobytes()
    changed = [i for i, (a, b) in enumerate(zip(grads_a, grads_b)) if a.tobytes() != b.tobytes()]
    assert changed, "the gradients do not depend on the fixed-order VJPs: the step does not use them"
    for a, b in zip(grads_a, grads_b):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)
