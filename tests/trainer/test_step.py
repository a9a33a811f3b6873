"""train_step: recording levels do not change training; recorded fingerprints are the reference's."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from traces.fingerprint import fingerprint
from trainer import model, rng
from trainer.config import apply_overrides
from trainer.presets import get_preset
from replay.record.recorder import lanes_to_uint64
from trainer.step import METRICS, compile_step, get_path, init_state, tensor_schema
from tests.trainer.loop_programs import loop_step

CFG = get_preset("tiny")
N_STEPS = 3


def batch(step: int) -> dict:
    tokens = np.random.default_rng([7, step]).integers(0, 256, (CFG.data.global_batch_size, CFG.model.seq_len + 1))
    return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}


def leaves_bytes(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def runs():
    """N_STEPS of tiny at each recording level, from the same initial state. The trainer loop's own
    programs (tests/trainer/loop_programs.py): the layer-level one is that of every `tiny` run in the
    suite (tests/tiny_run.py, test_spike.py's), so the session's compilation cache compiles it once;
    compile_step called on unplaced arrays lowered another program of its own per level."""
    out = {}
    for level in ("off", "step", "layer"):
        fn = loop_step(CFG, level)
        state, history = init_state(CFG), []
        for k in range(N_STEPS):
            before = jax.device_get(state)
            state, metrics = fn(state, batch(k))
            history.append((before, jax.device_get(metrics)))
        out[level] = (jax.device_get(state), history)
    return out


def test_recording_does_not_change_training(runs):
    reference = leaves_bytes(runs["off"][0])
    assert leaves_bytes(runs["step"][0]) == reference
    assert leaves_bytes(runs["layer"][0]) == reference
    losses = {lvl: [m["loss"].tobytes() for _, m in runs[lvl][1]] for lvl in runs}
    assert losses["off"] == losses["step"] == losses["layer"]


def test_the_equality_check_catches_a_one_bit_change(runs):
    state = runs["off"][0]
    flipped = jax.tree.map(np.array, state)
    flipped.params["block_00"]["mlp"]["up"]["kernel"].view(np.uint32)[3, 5] ^= 1
    assert leaves_bytes(flipped) != leaves_bytes(state)


def test_step_level_outputs(runs):
    _, history = runs["step"]
    for k, (_, m) in enumerate(history):
        assert set(m) == {name for name, _ in METRICS} | {"example_loss", "rng"}
        words = np.asarray(rng.key_words(rng.step_key(rng.dropout_key(CFG.seed), k)))
        assert np.array_equal(m["rng"], words)
        assert m["example_loss"].shape == (CFG.data.global_batch_size,)
        assert np.float32(np.mean(m["example_loss"])) == pytest.approx(m["loss"], rel=1e-6)
    assert history[0][1]["lr"] == 0.0 and history[1][1]["lr"] > 0  # warmup starts at 0


def test_recorded_levels_return_one_packed_vector_the_recorder_reads_by_slices(runs):
    """The step and layer programs return their record as ONE uint32 vector (one output buffer to
    dispatch and copy, as run.step's), laid out so that the recorder slices it (its packed plan)
    instead of reading field by field: a field out of the schema's order would fall back silently."""
    from replay.record.packed import PackedRecord
    from replay.record.recorder import _packed_plan
    from trainer.loop import make_schema

    for level in ("step", "layer"):
        _, metrics = runs[level][1][0]
        assert isinstance(metrics, PackedRecord) and len(jax.tree.leaves(metrics)) == 1, level
        schema = make_schema(CFG.data.global_batch_size, level, tensor_schema(CFG))
        plan = _packed_plan(metrics.layout, schema.metric_names, schema.example_metrics)
        assert plan is not None and ("fingerprints" in plan) == (level == "layer"), (level, metrics.layout)


def test_the_unpacked_program_of_older_runs_records_the_same_bits(runs):
    """trace.packed_record=false (what a run recorded before the field existed reads as) is the dict
    program those runs ran; its records are bit for bit the packed program's, and the comparison
    sees a one-bit change of the loss."""
    import dataclasses

    from replay.record.recorder import to_record
    from traces.schema import same_bits
    from trainer.loop import make_schema

    cfg = dataclasses.replace(CFG, trace=dataclasses.replace(CFG.trace, packed_record=False))
    schema = make_schema(CFG.data.global_batch_size, "step", tensor_schema(CFG))
    fn, state = loop_step(cfg, "step"), init_state(cfg)
    hashes = np.arange(CFG.data.global_batch_size, dtype=np.uint64)
    for k, (_, packed) in enumerate(runs["step"][1]):
        state, metrics = fn(state, batch(k))
        metrics = jax.device_get(metrics)
        assert isinstance(metrics, dict)
        old, new = to_record(schema, k, metrics, hashes), to_record(schema, k, packed, hashes)
        assert same_bits(schema, old, new), k
    changed = new.metrics.copy()
    changed.view(np.uint32)[0] ^= 1
    assert not same_bits(schema, old, dataclasses.replace(new, metrics=changed))


def test_layer_fingerprints_equal_the_numpy_reference(runs):
    names = [n for n, _ in tensor_schema(CFG)]
    final, history = runs["layer"]
    before, metrics = history[-1]
    fps = lanes_to_uint64(metrics["fingerprints"])
    assert len(fps) == len(names) == len(metrics["rms"])
    for i, name in enumerate(names):
        if name.startswith("param/"):
            x = np.asarray(get_path(final.params, name[len("param/"):]))
            assert int(fps[i]) == fingerprint(x), name
            assert metrics["rms"][i] == pytest.approx(np.sqrt(np.mean(x.astype(np.float64) ** 2)), rel=1e-5)
    # The state fingerprint is the fingerprint of the stacked per-leaf lanes, in param order.
    per_leaf = [fingerprint(np.asarray(get_path(before.params, n))) for n in model.param_names(CFG.model)]
    lanes = np.array([[fp >> 32, fp & 0xFFFFFFFF] for fp in per_leaf], np.uint32)
    assert int(fps[names.index("state/params")]) == fingerprint(lanes)


def test_forward_fingerprints_match_captured_activations(runs):
    before, metrics = runs["layer"][1][0]
    key = rng.step_key(rng.dropout_key(CFG.seed), 0)
    _, layers = model.apply(CFG.model, before.params, batch(0)["inputs"], dropout_key=key, capture=True)
    names = [n for n, _ in tensor_schema(CFG)]
    fps = lanes_to_uint64(metrics["fingerprints"])
    # Eager and jitted forward passes may round differently; the embedding lookup is exact.
    assert int(fps[names.index("embed")]) == fingerprint(np.asarray(layers["embed"]))


def test_fingerprints_catch_a_one_bit_parameter_change():
    fn = loop_step(CFG, "layer")  # the runs fixture's program
    state = init_state(CFG)
    flipped = jax.tree.map(np.array, jax.device_get(state))
    flipped.params["block_01"]["attn"]["o"]["kernel"].view(np.uint32)[0, 0] ^= 1 << 3
    _, a = fn(init_state(CFG), batch(0))
    _, b = fn(jax.tree.map(jax.numpy.asarray, flipped), batch(0))
    names = [n for n, _ in tensor_schema(CFG)]
    fa, fb = lanes_to_uint64(a["fingerprints"]), lanes_to_uint64(b["fingerprints"])
    differ = [names[i] for i in np.nonzero(fa != fb)[0]]
    assert differ[0] == "state/params"
    assert "block_01.attn" in differ and "block_00.attn" not in differ  # forward: from that layer on
    assert "param/block_01.attn.o.kernel" in differ


def test_dropout_changes_with_the_step_key():
    # tiny's own dropout (0.1) and the runs fixture's step-level program (a dropout of 0.5 was a
    # program compiled for this alone): a mask that ignored the step would give equal losses
    assert CFG.model.dropout > 0
    fn = loop_step(CFG, "step")
    _, a = fn(init_state(CFG), batch(0))
    moved = init_state(CFG)._replace(step=jax.numpy.asarray(1, jax.numpy.int32))
    _, b = fn(moved, batch(0))
    assert a["loss"] != b["loss"]  # the same batch with another step's dropout mask


def test_weight_decay_applies_to_matrices_only():
    from trainer.config import OptimizerConfig
    from trainer.optim import make_optimizer

    opt = make_optimizer(OptimizerConfig(lr=1.0, warmup_steps=0, decay_steps=10, weight_decay=0.5, grad_clip=0.0))
    params = {"w": np.ones((2, 2), np.float32), "scale": np.ones(2, np.float32)}
    updates, _ = opt.update(jax.tree.map(np.zeros_like, params), opt.init(params), params)
    assert np.all(np.asarray(updates["w"]) == -0.5) and np.all(np.asarray(updates["scale"]) == 0)


def test_the_same_step_arguments_give_the_same_jitted_program():
    # compile_step keeps its jitted functions, so a process that builds the step again (a replay
    # after training, bisect's runs) reuses the compiled program; other arguments, other programs.
    assert compile_step(CFG, "step") is compile_step(CFG, "step")
    assert compile_step(CFG, "step") is not compile_step(CFG, "off")
    other = apply_overrides(CFG, ["optimizer.lr=0.5"])
    assert compile_step(other, "step") is not compile_step(CFG, "step")


def test_summaries_of_more_than_2_to_the_31_elements_trace():
    """olmo-1b's optimizer state at trace level layer: the RMS divides by an element count over 2^31
    (an int argument JAX refused: OverflowError). Traced only, nothing allocated."""
    from trainer import sdc
    from trainer.step import _tree_summary

    big = [jax.ShapeDtypeStruct((2**16, 2**15), np.float32)] * 2  # 2^32 elements in all
    lanes, rms = jax.eval_shape(_tree_summary, big)
    assert lanes.shape == (1, 2) and rms.shape == (1,) and rms.dtype == np.float32
    cfg = apply_overrides(get_preset("tiny"), ["model.n_layers=1", "model.d_model=32768", "model.vocab_size=131072", "data.token_dtype=uint32",
                                               "model.d_ff=64", "model.n_heads=256", "model.n_kv_heads=256"])
    grads = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
    assert sum(x.size for x in jax.tree.leaves(grads)) > 2**31
    lanes, rms = jax.eval_shape(lambda g: sdc.microbatch_summaries(g, cfg), grads)
    assert rms.dtype == np.float32 and lanes.shape[0] == rms.shape[0] > 1
