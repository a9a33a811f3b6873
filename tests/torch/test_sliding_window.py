"""OLMo 3's sliding-window layers against the reference at a tiny size: HF's Olmo3 with a window
of 8 tokens on a 64-token sequence (3 sliding layers, then 1 full, as Olmo3Config's default
layer_types) is the same function as the trainer with model.sliding_window=8, with either
attention implementation; the trainer without the window is not."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from trainer import model as jmodel  # noqa: E402
from trainer import reference  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.reference_parity import KL_BAR, token_kl  # noqa: E402

M = ModelConfig(n_layers=4, init_std=0.2, seq_len=64, sliding_window=8, full_attention_every=4)


@pytest.fixture(scope="module")
def reference_run():
    if reference.generation() != "olmo3":
        pytest.skip("this transformers has no OLMo 3 (no sliding-window layers)")
    config = reference.hf_config(M)
    config.sliding_window = M.sliding_window  # the attention modules read it when built
    assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = transformers.Olmo3ForCausalLM(config).to(torch.float32).eval()
    params = reference.to_jax(reference.hf_tensors(hf, M), M)
    tokens = np.random.default_rng(0).integers(0, M.vocab_size, size=(1, M.seq_len), dtype=np.int32)
    with torch.no_grad():
        logits = hf(torch.from_numpy(tokens).long()).logits.float().numpy()
    return params, tokens, logits


@pytest.mark.parametrize("attention", ["explicit", "fused"])
def test_the_window_matches_olmo3s(reference_run, attention):
    params, tokens, ref = reference_run
    m = dataclasses.replace(M, attention=attention)
    logits = np.asarray(jmodel.apply(m, params, jnp.asarray(tokens)))
    assert token_kl(ref, logits).max() <= KL_BAR
    assert np.abs(ref - logits).max() < 1e-4


def test_without_the_window_the_model_is_not_the_reference(reference_run):
    params, tokens, ref = reference_run
    windowed = np.asarray(jmodel.apply(M, params, jnp.asarray(tokens)))
    full = np.asarray(jmodel.apply(dataclasses.replace(M, sliding_window=0), params, jnp.asarray(tokens)))
    assert np.abs(ref - full).max() > 100 * np.abs(ref - windowed).max()
