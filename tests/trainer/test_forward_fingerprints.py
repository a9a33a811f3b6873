"""Every forward fingerprint a layer-level record holds is the numpy reference fingerprint
(traces/fingerprint.py) of the activation the model captures under that name.

tests/trainer/test_step.py checks the parameter and state fingerprints, and of the forward
ones only the embedding (an exact lookup). Here every recorded forward tensor of every step is
checked: the step's record (the compiled layer-level step's outputs through the recorder's
`to_record`, with the run's schema) against the activations that the capture mechanism
(`step.loss_fn(..., capture=True)`, i.e. `model.apply(capture=True)`; in mesh-invariant mode
`invariant.value_and_grad`, which gathers each microbatch's capture in global order) yields for
the same state, batch and dropout key. So a record names the tensor it fingerprints: a
mislabelled, reordered or stale forward fingerprint fails, and so does a one-ULP change of one
element of one activation (shown).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from traces.fingerprint import fingerprint
from trainer import data, invariant, mesh as meshlib, model, rng, step as steplib
from trainer.config import apply_overrides
from trainer.presets import get_preset
from replay.record.recorder import to_record
from trainer.loop import make_schema

STEPS = 2
# Mesh-invariant with one block: it has every kind of layer output and call site (embedding,
# attention, MLP, block, final norm), and its two compiles (the step, the capture) were two thirds
# of this file's time with two blocks; `plain` keeps tiny's two.
CONFIGS = {"plain": get_preset("tiny"),
           "mesh-invariant": apply_overrides(get_preset("tiny"), ["mesh.mesh_invariant=true", "mesh.n_microbatches=8",
                                                                 "model.n_layers=1"])}


def batch(cfg, step: int) -> tuple[dict, np.ndarray]:
    tokens = np.random.default_rng([11, step]).integers(0, cfg.model.vocab_size,
                                                        (cfg.data.global_batch_size, cfg.model.seq_len + 1))
    arrays = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    return arrays, data.example_hashes(tokens)


@functools.partial(jax.jit, static_argnums=0)
def captured(cfg, state: steplib.TrainState, arrays: dict) -> dict:
    """The layer activations of the step `state` is about to take, as the model captures them."""
    key = rng.step_key(jax.random.wrap_key_data(state.key, impl="threefry2x32"), state.step)  # as train_step
    if cfg.mesh.mesh_invariant:
        (_, aux), _ = invariant.value_and_grad(state.params, cfg, arrays, key, True, None)
    else:
        (_, aux), _ = jax.value_and_grad(steplib.loss_fn, has_aux=True)(
            state.params, cfg, arrays["inputs"], arrays["targets"], key, True)
    return aux["layers"]


def forward_mismatches(schema, record, layers: dict) -> list[str]:
    """Forward fields whose recorded fingerprint is not the reference fingerprint of `layers[name]`."""
    return [name for i, (name, kind) in enumerate(schema.tensors)
            if kind == "forward" and fingerprint(np.asarray(layers[name])) != int(record.fingerprints[i])]


@pytest.fixture(scope="module", params=["plain", pytest.param("mesh-invariant", marks=pytest.mark.slow)])
def recorded(request):
    """(cfg, schema, [(record, captured layers)] per step) for STEPS layer-level steps."""
    cfg = CONFIGS[request.param]
    schema = make_schema(cfg.data.global_batch_size, "layer", steplib.tensor_schema(cfg))
    # The step as the trainer compiles and feeds it (trainer/loop.py): the state in the layout the
    # step returns it in, so that every step runs one program. Unsharded, the mesh-invariant step's
    # second call met another input layout and compiled the step (~7 s) and `captured` again.
    mesh = meshlib.make_mesh(cfg.mesh)
    shardings = meshlib.state_shardings(mesh, meshlib.abstract_state(cfg))
    fn = steplib.compile_step(cfg, "layer", shardings, meshlib.batch_sharding(mesh))
    state, out = meshlib.init_sharded_state(cfg, mesh), []
    for k in range(STEPS):
        arrays, hashes = batch(cfg, k)
        arrays = meshlib.global_batch(arrays, mesh)
        layers = jax.device_get(captured(cfg, state, arrays))  # before the step donates the state
        state, metrics = fn(state, arrays)
        out.append((to_record(schema, k, jax.device_get(metrics), hashes), layers))
    return cfg, schema, out


def test_every_forward_fingerprint_is_the_captured_activations(recorded):
    cfg, schema, steps = recorded
    forward = [name for name, kind in schema.tensors if kind == "forward"]
    assert forward == model.layer_names(cfg.model)  # every layer output is recorded, in execution order
    for record, layers in steps:
        assert sorted(layers) == sorted(forward)
        assert forward_mismatches(schema, record, layers) == [], record.step


def test_the_check_fails_on_one_changed_element_or_swapped_names(recorded):
    cfg, schema, steps = recorded
    record, layers = steps[-1]
    nudged = dict(layers)
    mlp = f"{model.block_names(cfg.model)[-1]}.mlp"  # the last block's
    x = np.array(layers[mlp])
    x.flat[17] = np.nextafter(x.flat[17], np.float32(np.inf))
    nudged[mlp] = x
    assert forward_mismatches(schema, record, nudged) == [mlp]
    swapped = {**layers, "block_00.attn": layers["block_00.mlp"], "block_00.mlp": layers["block_00.attn"]}
    assert forward_mismatches(schema, record, swapped) == ["block_00.attn", "block_00.mlp"]
    stale = steps[0][1]  # the previous step's activations
    assert set(forward_mismatches(schema, record, stale)) == set(layers)
