"""The trainer's model against its torch reference (HF transformers' OLMo): the name map is the
trainer's own, weights convert both ways through safetensors bit for bit, the converted models
are the same function (per-token KL <= 1e-6 on 512 tokens, and a port bug is caught), and a
torch run recorded under the map agrees bit for bit with a JAX trainer step where it must."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from trainer import model as jmodel  # noqa: E402
from trainer import reference  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.presets import get_preset
from trainer.reference_parity import KL_BAR, forward_parity  # noqa: E402

M = ModelConfig()  # tiny: 2 blocks, GQA 4 query / 2 kv heads, QK-norm, untied


@pytest.mark.parametrize("m", [M, ModelConfig(tied_embeddings=True, n_layers=3, n_kv_heads=4)], ids=["tiny", "tied"])
def test_the_name_maps_are_the_trainers_names(m):
    assert [j for j, _, _ in reference.param_map(m)] == list(jmodel.param_names(m))
    assert [j for j, _ in reference.layer_map(m)] == jmodel.layer_names(m)
    for block in jmodel.block_names(m):
        fine = [j for j, _ in reference.fine_map(m, block)]
        captures = jmodel.block_capture_names(m, block)
        assert fine == [n for n in captures if n in fine]  # a subsequence, in execution order
    hf = reference.hf_model(m)
    assert {h for _, h, _ in reference.param_map(m)} == {n for n, _ in hf.named_parameters()}
    modules = dict(hf.named_modules())
    assert all(path in modules for _, path in reference.layer_map(m) + reference.fine_map(m, "block_00"))


def _bits(tree: dict) -> dict:
    return {k: np.asarray(v).tobytes() for k, v in tree.items()}


def test_weights_round_trip_both_ways_through_safetensors(tmp_path):
    import jax

    hf = reference.hf_model(M, seed=1)
    original = reference.hf_tensors(hf, M)
    reference.save_safetensors(tmp_path / "model.safetensors", original)  # HF's names, HF's layouts
    params = reference.to_jax(reference.load_safetensors(tmp_path / "model.safetensors"), M)
    reference.save_safetensors(tmp_path / "jax.safetensors", reference.flat_jax(params, M))
    back = reference.to_hf(reference.nested_jax(reference.load_safetensors(tmp_path / "jax.safetensors"), M), M)
    assert _bits(back) == _bits(original)
    assert params["block_00"]["attn"]["q"]["kernel"].shape == (M.d_model, M.n_heads * M.head_dim)

    init = jax.tree.map(np.asarray, jmodel.init_params(M, jax.random.key(3)))
    other = reference.hf_model(M, seed=2)
    reference.load_into(other, reference.to_hf(init, M), M)
    assert _bits(reference.flat_jax(reference.to_jax(reference.hf_tensors(other, M), M), M)) == \
        _bits(reference.flat_jax(init, M))


def test_conversion_refuses_weights_of_another_shape():
    hf = reference.hf_tensors(reference.hf_model(M), M)
    with pytest.raises(reference.ReferenceConfigError, match="missing"):
        reference.to_jax(hf, dataclasses.replace(M, n_layers=3))
    with pytest.raises(reference.ReferenceConfigError, match="shape"):
        reference.to_jax(hf, dataclasses.replace(M, d_ff=128))


@pytest.mark.parametrize("direction", ["hf_to_jax", "jax_to_hf"])
def test_forward_parity_on_512_tokens(direction):
    # init_std 0.2: logits of magnitude ~8, as a trained model's (at 0.02 they are ~0.6 and any
    # two near-uniform distributions have a small KL)
    r = forward_parity(dataclasses.replace(M, init_std=0.2), seq_len=512, direction=direction)
    assert r["generation"] in ("olmo3", "olmo2")
    assert r["max_abs_logit"] > 4
    assert r["max_token_kl"] <= KL_BAR, r
    assert r["max_abs_logit_diff"] < 1e-4, r
    assert r["layers"]["embed"]["max_abs_diff"] == 0.0  # a gather: the same bits


def test_olmo2_is_the_same_function(monkeypatch):
    """Where transformers has no OLMo 3 the reference is OLMo 2: the same function at these lengths."""
    monkeypatch.setattr(reference, "generation", lambda: "olmo2")
    assert type(reference.hf_model(M)).__name__ == "Olmo2ForCausalLM"
    r = forward_parity(dataclasses.replace(M, init_std=0.2), seq_len=512)
    assert r["generation"] == "olmo2" and r["max_token_kl"] <= KL_BAR, r


def test_parity_catches_a_port_bug():
    r = forward_parity(M, seq_len=512, corrupt="block_01.attn.o.kernel")  # a transposed kernel
    assert r["max_token_kl"] > 100 * KL_BAR
    parted = [n for n, v in r["layers"].items() if v["rel_l2"] > 1e-3]
    assert parted[0] == "block_01.attn"  # the first layer that parts is the one with the bug


def test_configs_the_reference_cannot_be_are_refused():
    for change, words in [({"dropout": 0.1}, "dropout"), ({"qk_norm": False}, "qk_norm"),
                          ({"bf16_block": 0}, "bf16_block")]:
        with pytest.raises(reference.ReferenceConfigError, match=words):
            reference.check(dataclasses.replace(M, **change))
    reference.check(get_preset("olmo3-7b").model)  # the presets themselves are representable


@pytest.mark.slow  # compiles the trainer's layer-level step (about 3 s on 2 idle cores, one block)
def test_a_torch_run_and_a_jax_step_agree_bit_for_bit_on_inputs(tmp_path):
    """Same converted weights, same rows: the JAX trainer's layer-level step and the recorded torch
    step have equal example hashes, initial-parameter and embedding fingerprints (exact in both
    frameworks), and close but not equal attention outputs (float rounding differs)."""
    import jax
    import jax.numpy as jnp

    import replay.torch
    import traces
    from trainer.data import example_hashes
    from trainer.optim import make_optimizer
    from trainer.step import TrainState, compile_step, tensor_schema

    # One block: every tensor compared is the embedding, the first block's attention, the logits or the
    # whole state, which one block has as two do; the layer-level step compiles in about half the time.
    cfg = dataclasses.replace(get_preset("tiny"), model=dataclasses.replace(get_preset("tiny").model, dropout=0.0,
                                                                            n_layers=1))
    m = cfg.model
    hf = reference.hf_model(m, seed=0).train()
    params = jax.tree.map(jnp.asarray, reference.to_jax(reference.hf_tensors(hf, m), m))  # before torch trains
    rows = np.random.default_rng(0).integers(0, m.vocab_size, size=(4, m.seq_len + 1)).astype(np.int32)

    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    run = replay.torch.init(tmp_path / "torch", model=hf, optimizer=opt, names=reference.tensor_names(m))
    t = torch.from_numpy(rows).long()
    with run.step(t) as rec:
        logits = hf(t[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, m.vocab_size), t[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        rec.metrics(loss=loss)
    run.finish()
    torch_run = traces.Run.open(tmp_path / "torch")
    got = dict(zip(torch_run.schema.tensor_names, torch_run.trace.read(0).fingerprints))
    rms = dict(zip(torch_run.schema.tensor_names, torch_run.trace.read(0).rms))

    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                       opt_state=make_optimizer(cfg.optimizer).init(params), key=jnp.zeros((2,), jnp.uint32))
    _, metrics = compile_step(cfg, "layer")(state, {"inputs": jnp.asarray(rows[:, :-1]),
                                                    "targets": jnp.asarray(rows[:, 1:])})
    lanes = np.asarray(metrics["fingerprints"]).astype(np.uint64)
    want = dict(zip([n for n, _ in tensor_schema(cfg)], (lanes[:, 0] << np.uint64(32)) | lanes[:, 1]))
    jax_rms = dict(zip([n for n, _ in tensor_schema(cfg)], np.asarray(metrics["rms"])))

    assert np.array_equal(torch_run.trace.read(0).example_hashes, example_hashes(rows))
    assert got["state/params"] == want["state/params"]  # the initial parameters, bit for bit
    assert got["embed"] == want["embed"]
    assert got["block_00.attn"] != want["block_00.attn"]  # fingerprints do tell the frameworks apart
    assert rms["block_00.attn"] == pytest.approx(jax_rms["block_00.attn"], rel=1e-5)
    assert rms["logits"] == pytest.approx(jax_rms["logits"], rel=1e-5)
    assert float(torch_run.trace.read(0).metrics[0]) == pytest.approx(float(metrics["loss"]), rel=1e-6)
