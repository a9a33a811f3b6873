"""Mesh-invariant mode end to end: what README.md and trainer/invariant.py promise, bit for bit.

Whole runs of tiny with one block (it has every kind of call site the fixed-order backward covers;
no claim here is about two blocks), each device count in a fresh process whose XLA_FLAGS fix it
before JAX starts (this pytest process has one device and lacks mesh-invariant mode's settings):
- a run recorded on 4 devices replays bit-exactly with `replay run` on 2 and 1 (where the
  manifest's measured set says so; elsewhere the report must give distances, not say bit-exact);
- runs recorded on 8 and 4 devices and by 2 processes x 2 devices equal the same run on 1 device
  in every stored byte of every trace record (metrics, per-example losses, RNG words, hashes, every
  fingerprint and RMS) and in every array of every checkpoint.
The comparisons are shown to fail on real differences: without the fixed-order backward
(trainer/model.py, `fixed_backward`) 1 and 8 devices part at step 0 in the gradients, which
is also why a run that silently fell back to autodiff's backward would not equal the recorded
ones; and a plain data-parallel run recorded on 8 devices does not replay bit-exactly on 1 (that
one is tests/replay/test_noise.py's, whose runs are plain 1 and 8 device runs).

Runs on the same device count share one process (the CLI's commands in turn, as `replay` runs
them): 6 processes for the 9 mesh-invariant runs and 2 replays (two runs at trace level step: every
metric there, param_norm included, equal on 1 and 4 devices).

The fast test shows in-process that the mesh-invariant step runs every softmax and RMSNorm
backward through the fixed-order VJPs; that the gradients are made of what those VJPs compute
(another summation order, as correct, gives other gradient bits) is test_invariant_scatter.py's,
whose 8-device probe already compiles this gradient on one device (one compile fewer than here).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.trainer.invariant_probe import vjps
from tests.ports import free_port
from tests.trainer.test_train_e2e import env, replay_cmd
from traces import Run, compare
from trainer import invariant, model, step as steplib
from trainer.config import apply_overrides, from_dict
from trainer.presets import get_preset

ROOT = Path(__file__).resolve().parents[2]
INVARIANT = ["mesh.mesh_invariant=true", "mesh.n_microbatches=8"]
STEPS, EVERY = 4, 2  # checkpoints 0, 2 and 4: states compared mid-run and at the end
ONE_BLOCK = ["model.n_layers=1"]  # compiles faster; every kind of layer and call site is in it
RUN_SETS = INVARIANT + ONE_BLOCK + [f"steps={STEPS}", f"checkpoint.every_steps={EVERY}"]
# trace.level=step: param_norm was an XLA reduce over the sharded parameters there and 1 and 4
# devices recorded different bits at steps 4, 5, 7 and 9 (1 ULP); layer-level steps took it whole.
STEP_LEVEL = INVARIANT + ONE_BLOCK + ["trace.level=step", "steps=10", "checkpoint.every_steps=0"]
REPLAYED = (1, 3)  # `replay run --steps 1:3`: from the checkpoint at 0, so step 0 is the warmup

# `replay` commands in turn in one fresh process (argv[1]: a JSON list of {"args", "fallback"}),
# their results as one JSON line. "fallback": the loop compiles its step with fixed_backward=False
# for that command: autodiff's backward inside the microbatch scheme, everything else (scheme,
# process settings) as mesh-invariant mode has it. An argument of compile_step, so the programs it
# keeps for the other commands are other programs.
_COMMANDS = r"""
import functools, json, sys
from typer.testing import CliRunner
from replay.cli.app import app
from trainer import step
kept = step.compile_step
out = []
for job in json.loads(sys.argv[1]):
    if job["fallback"]:  # the loop lowers through trainer.mesh.lower_step, which calls step.compile_step
        step.compile_step = functools.partial(kept, fixed_backward=False)
    try:
        r = CliRunner().invoke(app, job["args"], env={"REPLAY_DEBUG": None})
    finally:
        step.compile_step = kept
    crash = None if r.exception is None or isinstance(r.exception, SystemExit) else repr(r.exception)
    out.append({"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr, "crash": crash})
print(json.dumps(out))
"""


def cli_env(devices: int) -> dict:
    """This environment for a process with `devices` CPU devices and no thread-pool setting of its
    own (mesh-invariant mode pins the pool itself)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def manifest(path: Path) -> dict:
    return json.loads((path / "run.json").read_text())


def commands(devices: int, *jobs: tuple[list[str], bool]) -> list[dict]:
    """Each (args, fallback) job's {"exit_code", "stdout", "stderr"}, run in turn in one process
    with `devices` devices."""
    payload = json.dumps([{"args": args, "fallback": fallback} for args, fallback in jobs])
    done = subprocess.run([sys.executable, "-c", _COMMANDS, payload], cwd=ROOT, env=cli_env(devices),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(r["crash"] is None for r in results), [r["crash"] for r in results]
    return results


# ------------------------------------------------------------------------------ comparing runs
@functools.lru_cache(maxsize=None)  # the 1-device runs are each compared with several others
def _checkpoint_leaves(path: Path, step: int) -> list[tuple[str, bytes]]:
    """Every array of checkpoint `step`, restored on this process's one device, as raw bytes."""
    from trainer import mesh as meshlib
    from replay.record.checkpointer import Checkpointer

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

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    """Paths of the runs "1", "4", "8" and "2x2" (2 processes x 2 devices) in mesh-invariant mode and
    "fallback-1" / "fallback-8" without the fixed-order backward; `replays[n]`: the results of
    `replay run --json` of run "4" on n devices; `misfit`: `replay train` on 4 devices with 2 microbatches."""
    root = tmp_path_factory.mktemp("invariant-claims")
    paths = {name: root / name for name in ("1", "4", "8", "2x2", "fallback-1", "fallback-8", "misfit", "step-1",
                                            "step-4")}

    def train(name: str, *overrides: str, base: list[str] = RUN_SETS) -> list[str]:
        return ["train", "--preset", "tiny", "--out", str(paths[name]), *sets(base + list(overrides))]

    replay = (["run", str(paths["4"]), "--steps", "%d:%d" % REPLAYED, "--json"], False)
    misfit, four, step_four = commands(4, (train("misfit", "mesh.n_microbatches=2"), False), (train("4"), False),
                                       (train("step-4", base=STEP_LEVEL), False))
    assert four["exit_code"] == 0, four["stderr"][-2000:]
    trained = commands(8, (train("8"), False), (train("fallback-8"), True)) + [step_four]
    *trained_one, replay_one = commands(1, (train("1"), False), (train("fallback-1"), True),
                                        (train("step-1", base=STEP_LEVEL), False), replay)
    (replay_two,) = commands(2, replay)
    for done in trained + trained_one:
        assert done["exit_code"] == 0, done["stderr"][-2000:]
    port = free_port()
    procs = [subprocess.Popen(replay_cmd(*train("2x2"), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                         "--process-id", str(i)),
                              cwd=ROOT, env=env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    return SimpleNamespace(path=paths, replays={1: replay_one, 2: replay_two}, misfit=misfit)


@pytest.mark.slow
def test_invariant_run_records_its_settings(runs):
    m = manifest(runs.path["4"])
    assert m["config"]["mesh"]["mesh_invariant"] and m["environment"]["device_count"] == 4
    assert m["invariant_device_counts"] == list(invariant.INVARIANT_COUNTS["cpu"])  # 8 microbatches fit them all
    assert m["invariant"]["pool_threads"] == invariant.POOL_THREADS and m["invariant"]["settings_problem"] is None
    assert invariant.ISA_FLAG in m["environment"]["xla_flags"]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 1])
def test_invariant_run_replays_on_fewer_devices(runs, devices):
    counts = manifest(runs.path["4"])["invariant_device_counts"]
    out = runs.replays[devices]
    assert out["exit_code"] in (0, 1), out["stderr"]
    report = json.loads(out["stdout"])
    first, last = REPLAYED
    assert report["replayed"] == last - first + 1 and report["warmup_replayed"] == 1  # from the checkpoint at 0
    if devices in counts:  # measured to agree: the contract promises bits, and they are there
        assert report["contract"]["expect_bits"], report["contract"]
        assert "mesh-invariant" in report["contract"]["line"]
        assert out["exit_code"] == 0 and report["all_bit_exact"], report["first_mismatch"]
        assert report["bit_exact"] == last - first + 1 and report["warmup_bit_exact"] == 1
    else:  # not measured: bits not promised; any difference comes with distances
        assert not report["contract"]["expect_bits"] and report["contract"]["line"].startswith("measured only")
        if not report["all_bit_exact"]:
            assert out["exit_code"] == 1
            assert any(f["distance"] for f in report["first_mismatch"]["fields"])


@pytest.mark.slow
def test_microbatches_that_do_not_fit_the_devices_fail_in_one_line(runs):
    out = runs.misfit
    assert out["exit_code"] == 2
    assert "mesh.n_microbatches=2 is not a multiple of the 4 devices" in out["stderr"]
    assert len(out["stderr"].strip().splitlines()) == 1
    assert "Traceback" not in out["stderr"] + out["stdout"] and not runs.path["misfit"].exists()


@pytest.mark.slow
@pytest.mark.parametrize("devices", ["8", "4"])
def test_eight_and_four_devices_record_the_bits_of_one(runs, devices):
    one, other = runs.path["1"], runs.path[devices]
    environment = manifest(other)["environment"]
    assert (environment["device_count"], environment["process_count"]) == (int(devices), 1)
    assert int(devices) in manifest(other)["invariant_device_counts"] and 1 in manifest(one)["invariant_device_counts"]
    assert differences(one, other) == []


@pytest.mark.slow
def test_four_devices_record_the_bits_of_one_at_the_step_level(runs):
    """Every metric's bits at every step (param_norm included) without the layer level's records."""
    one, four = Run.open(runs.path["step-1"]), Run.open(runs.path["step-4"])
    assert (one.manifest["environment"]["device_count"], four.manifest["environment"]["device_count"]) == (1, 4)
    assert not one.schema.tensors and one.trace.end == four.trace.end == 10
    names = one.schema.metric_names
    assert "param_norm" in names
    differ = [(k, name) for k in range(one.trace.end) for i, name in enumerate(names)
              if one.trace.read(k).metrics[i].tobytes() != four.trace.read(k).metrics[i].tobytes()]
    assert differ == []
    assert [k for k in range(one.trace.end) if one.trace.raw_frame(k) != four.trace.raw_frame(k)] == []
    assert compare(one.trace, four.trace).identical


@pytest.mark.slow
def test_two_processes_of_two_devices_record_the_bits_of_one(runs):
    """Also what 2 processes record at all: both hosts' halves of every batch in global order
    (the per-example hashes), and the state fingerprints both processes compute (a collective)
    and process 0 writes to the manifest."""
    one, multi = runs.path["1"], runs.path["2x2"]
    env4 = manifest(multi)["environment"]
    assert (env4["device_count"], env4["process_count"]) == (4, 2)
    assert Run.open(multi).status == "complete"
    assert manifest(multi)["checkpoints"] == [0, EVERY, STEPS]
    assert manifest(multi)["checkpoint_fingerprints"] == manifest(one)["checkpoint_fingerprints"]
    assert differences(one, multi) == []


@pytest.mark.slow
def test_without_the_fixed_order_backward_one_and_eight_devices_differ(runs):
    """The same comparison fails on a real difference: autodiff's softmax/RMSNorm backward sums
    in an order XLA:CPU picks per program, so 1 and 8 devices part in the gradients at step 0.
    Which backward field compare lists first (grad_norm, or a gradient tensor when the norms
    happen to round alike) depends on the CPU's code: on an AMD EPYC the norms differ too."""
    found = differences(runs.path["fallback-1"], runs.path["fallback-8"])
    assert found and found[0].startswith("step 0 backward "), found[:3]
    assert any(f.startswith("step 0 backward grad/") for f in found), found[:3]
    assert not any(f.startswith("step 0 forward") or f.startswith("step 0 loss") for f in found)


@pytest.mark.slow
def test_mesh_invariant_runs_used_the_fixed_order_backward(runs):
    """A mesh-invariant run that fell back to autodiff's backward would equal fallback-1 bit for
    bit; the recorded run's gradients differ from it (and its forward pass does not)."""
    found = differences(runs.path["1"], runs.path["fallback-1"])
    assert found and found[0].startswith("step 0 backward "), found[:3]
    assert any(f.startswith("step 0 backward grad/") for f in found), found[:3]
    assert not any(f.startswith("step 0 forward") or f.startswith("step 0 loss") for f in found)
    assert any(f.startswith(f"checkpoint {EVERY} ") for f in found)  # the states compared differ too


# ------------------------------------------------------------------------------ fast: in-process

CFG = apply_overrides(get_preset("tiny"), INVARIANT)


def _batch(cfg) -> dict:
    shape = (cfg.data.global_batch_size, cfg.model.seq_len)
    tokens = np.random.default_rng(5).integers(0, cfg.model.vocab_size, (shape[0], shape[1] + 1))
    return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


@contextlib.contextmanager
def _patched_vjps(monkeypatch, softmax_bwd, rms_bwd):
    softmax, rms = vjps(softmax_bwd, rms_bwd)
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
