"""JAX trainer runs that record distance sketches (trace.sketches=true, trainer/sketches.py): the
sketches are the numpy reference's within its tolerance, the state's are of the state entering
the step, training keeps its bits, and the cross-framework bisect reads them from the trace
instead of replaying the JAX run: same distances as the replay path within the sketches' stated
tolerance, a clean pair within the floor, a port bug still localized."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.torch.reference_pair import DEMO_STEPS, clean_config, demo, demo_config, port_run
from traces.sketch import DEFAULT_WIDTH, bucket_and_sign, sketch

STEPS = 3  # the steps whose replay the trace estimate is checked against
READS_SHARED_RUNS = True  # tests/conftest.py orders this file after the one that makes the shared runs


def _sketched(cfg):
    return dataclasses.replace(cfg, trace=dataclasses.replace(cfg.trace, sketches=True))


def _bucket_abs_sums(x, width: int) -> np.ndarray:
    a = np.asarray(x, np.float64).reshape(-1)
    bucket, _ = bucket_and_sign(np.arange(a.size, dtype=np.uint64).astype(np.uint32), width)
    return np.bincount(bucket, weights=np.abs(a), minlength=width)


def _within(got, leaves, width: int = DEFAULT_WIDTH) -> bool:
    """traces/sketch.py's tolerance: |S_jax - S_ref| <= 2**-22 * sum of |v| over the bucket."""
    want = sum(sketch(np.asarray(x), width)[0].astype(np.float64) for x in leaves)
    bound = sum(_bucket_abs_sums(x, width) for x in leaves)
    return bool(np.all(np.abs(np.asarray(got, np.float64) - want) <= 2.0 ** -22 * bound + 1e-30))


def test_the_sketched_step_keeps_its_bits_and_sketches_the_state_entering_it():
    from trainer import mesh as meshlib, model
    from trainer.step import get_path, init_state, tensor_schema

    # The demo's JAX config (tests/torch/reference_pair.py: sketches on, level layer) and its step as
    # the trainer's loop lowers it: the very program the session's shared demo run compiles (this file
    # reads that run below), so the session's compilation cache compiles it once; only the level-off
    # program is this test's own. (A one-block copy of the config was two programs of its own.)
    cfg = demo_config()
    assert cfg.trace.sketches and cfg.trace.level == "layer"
    names = [n for n, _ in tensor_schema(cfg)]
    shape = (cfg.data.global_batch_size, cfg.model.seq_len)
    rows = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (shape[0], shape[1] + 1)).astype(np.int32)
    batch = {"inputs": jnp.asarray(rows[:, :-1]), "targets": jnp.asarray(rows[:, 1:])}
    mesh = meshlib.make_mesh(cfg.mesh)

    def program(level: str):
        lowered, shardings, batch_sharding, abstract = meshlib.lower_step(cfg, level, mesh)
        compiled = lowered.compile()
        return compiled, abstract, lambda state: compiled(jax.device_put(state, shardings),
                                                          jax.device_put(batch, batch_sharding))

    # Reading the entering state for its sketches must not make XLA copy the donated state.
    layer, abstract, run_layer = program("layer")
    entry = layer.as_text()
    entry = entry[entry.index("\nENTRY"):]
    params_in = set(re.findall(r"^\s*(%\S+) = \S+ parameter\(", entry, re.M))
    copied = sum(int(np.prod([int(d) for d in dims.split(",") if d]))
                 for dims, src in re.findall(r"= \w+\[([0-9,]*)\]\S* copy\((%[^)]+)\)", entry) if src in params_in)
    assert copied < 0.01 * sum(x.size for x in jax.tree.leaves(abstract)), copied

    # The state entering step 1 (on the host: each program is given its own copy to donate). The
    # warmup's learning rate is 0 at step 0 only, so step 1 moves the parameters.
    entering = jax.device_get(run_layer(init_state(cfg))[0])
    leaves0 = [np.asarray(get_path(entering.params, n)) for n in model.param_names(cfg.model)]
    sketched_state, metrics = run_layer(entering)
    off_state, _ = program("off")[2](entering)
    assert float(metrics["lr"]) > 0
    # training results keep their bits with sketches on
    for a, b in zip(jax.tree.leaves(sketched_state), jax.tree.leaves(off_state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()

    sk, norms = np.asarray(metrics["sketches"]), np.asarray(metrics["norms"])
    assert sk.shape == (len(names), DEFAULT_WIDTH) and norms.shape == (len(names),)
    after = [np.asarray(get_path(sketched_state.params, n)) for n in model.param_names(cfg.model)]
    # state/params: the sum of the entering leaves' sketches, not of the updated ones
    assert _within(sk[names.index("state/params")], leaves0)
    assert not _within(sk[names.index("state/params")], after)
    i = names.index("param/embed.embedding")
    assert _within(sk[i], [get_path(sketched_state.params, "embed.embedding")])
    assert not _within(sk[i], [get_path(init_state(cfg).params, "embed.embedding")])
    np.testing.assert_allclose(norms[i], np.linalg.norm(np.asarray(get_path(sketched_state.params,
                                                                             "embed.embedding"), np.float64)), rtol=1e-5)


def test_sketches_with_the_sdc_checks_are_refused():
    from trainer import sketches
    from trainer.config import ConfigError

    cfg = _sketched(clean_config(STEPS))
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, mesh_invariant=True),
                              check=dataclasses.replace(cfg.check, replicas=True))
    with pytest.raises(ConfigError, match="trace.sketches"):
        sketches.check(cfg)


pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs():
    """The session's shared pair (tests/torch/reference_pair.py): the reference demo's torch run and
    its clean JAX port, which records sketches, and the port with the RMSNorm epsilon bug, sketched."""
    from traces import Run

    d = demo()
    return {"torch": Run.open(d["reference"]), "jax": Run.open(d["jax"]), "jax-bug": Run.open(port_run("norm_eps"))}


@pytest.fixture
def no_replay(monkeypatch):
    import replay.engine.replayer

    replays = []

    def refuse(self, *a, **k):
        replays.append(a)
        raise AssertionError("the cross bisect replayed a run that records sketches")

    monkeypatch.setattr(replay.engine.replayer.Replayer, "__init__", refuse)
    return replays


@pytest.mark.slow
def test_a_clean_pair_is_judged_from_the_traces_alone(runs, no_replay):
    from replay.bisect.cross import cross_bisect

    assert runs["jax"].schema.sketch_width == runs["torch"].schema.sketch_width == DEFAULT_WIDTH
    report = cross_bisect(runs["jax"], runs["torch"])
    assert report.failure is None, report.failure
    assert no_replay == [] and report.source == "traces"
    assert report.within_noise, report.to_json()
    assert sorted(report.distances) == list(range(DEMO_STEPS))
    assert report.distances[1]["block_00.attn"] > 0  # measured, not just "fingerprints differ"


def _tolerance(rj, rt, i: int, a: int) -> float:
    """How far the trace estimate may be from the replay's: JAX's float32 sketch vs the host's float64
    one differ by |dS_j| <= 2**-22 * (sum of |v| in bucket j) (traces/sketch.py), and
    sum_j (bucket |v| sum)^2 <= rows * ||v||^2 (a row puts one element in each bucket); elements =
    (norm / rms)^2 from the record, rows = elements / W (+ one per leaf of a pytree summary)."""
    elements = (float(rj.norms[i]) / float(rj.rms[i])) ** 2 if rj.rms[i] > 0 else 0.0
    den = max(float(rj.norms[i]), float(rt.norms[a]))
    return 2.0 ** -22 * np.sqrt(elements / DEFAULT_WIDTH + 64) * float(rj.norms[i]) / den if den else 0.0


@pytest.mark.slow
def test_the_trace_estimate_is_the_replay_estimate_within_the_sketch_tolerance(runs):
    from replay.bisect.cross_distance import compared_names, from_replay, from_traces

    t, j = runs["torch"], runs["jax"]
    names = compared_names(t, j)
    traced = dict(from_traces(t, j, range(STEPS), names))
    replays = []
    replayed = dict(from_replay(t, j, range(STEPS), names, on_replay=replays.append))
    assert replays == list(range(STEPS))
    index = {n: i for i, n in enumerate(j.schema.tensor_names)}
    at = {n: a for a, n in enumerate(t.schema.tensor_names)}

    def outside(traced_k: dict, k: int) -> list[str]:
        rj, rt = j.trace.read(k), t.trace.read(k)
        return [n for n, i in index.items() if n in traced_k and n in replayed[k] and abs(traced_k[n] - replayed[k][n])
                > _tolerance(rj, rt, i, at[n]) + 1e-6 * replayed[k][n]]

    for k in range(STEPS):
        assert sum(n in traced[k] and n in replayed[k] for n in index) > 50
        assert outside(traced[k], k) == [], k
    # the tolerance is tight enough to tell another pair's estimate (the port bug's at step 0)
    assert outside(dict(from_traces(t, runs["jax-bug"], [0], names))[0], 0)


@pytest.mark.slow
def test_a_port_bug_is_localized_from_the_traces(runs, no_replay):
    from replay.bisect.cross import cross_bisect
    from trainer.port_bugs import PORT_BUGS

    # refine=False: naming the op inside the layer re-runs the step by design (tests/torch/test_port_ops.py)
    report = cross_bisect(runs["torch"], runs["jax-bug"], refine=False)
    assert no_replay == [] and report.source == "traces"
    bug = PORT_BUGS["norm_eps"]
    assert (report.first_step, report.first_layer, report.cause) == (0, bug.first_tensor, bug.kind)
    assert report.ratio > 100
