"""trainer.reference.hf_config passes the trainer's sliding window and layer pattern to OLMo 3
(Olmo3Config's sliding_window and layer_types), so the reference built from the config alone is
the trainer's function at a window smaller than the sequence, with a pattern other than
Olmo3Config's default, and without a window (every layer full)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from trainer import model as jmodel  # noqa: E402
from trainer import reference  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.reference_parity import KL_BAR, token_kl  # noqa: E402

# window 4 on 32 tokens; every 2nd block full, where Olmo3Config's default has every 4th
M = ModelConfig(n_layers=4, init_std=0.2, seq_len=32, sliding_window=4, full_attention_every=2)

pytestmark = pytest.mark.skipif(reference.generation() != "olmo3", reason="this transformers has no OLMo 3")


def _pair(m: ModelConfig):
    hf = reference.hf_model(m, seed=0)  # from hf_config alone: nothing set on the config by hand
    params = reference.to_jax(reference.hf_tensors(hf, m), m)
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, size=(2, m.seq_len), dtype=np.int32)
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens).long()).logits.float().numpy()
    return hf, params, tokens, ref


def test_the_config_carries_the_window_and_the_layer_pattern():
    config = reference.hf_config(M)
    assert config.sliding_window == 4
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert reference.hf_config(dataclasses.replace(M, sliding_window=0)).layer_types == ["full_attention"] * 4


@pytest.mark.parametrize("window", [4, 0])
def test_the_reference_is_the_trainers_function(window):
    m = dataclasses.replace(M, sliding_window=window)
    _, params, tokens, ref = _pair(m)
    logits = np.asarray(jmodel.apply(m, params, jnp.asarray(tokens)))
    assert token_kl(ref, logits).max() <= KL_BAR
    assert np.abs(ref - logits).max() < 1e-4
    # the comparison sees the window: the other attention is far from the reference
    other = np.asarray(jmodel.apply(dataclasses.replace(m, sliding_window=8 if window == 0 else 0), params,
                                    jnp.asarray(tokens)))
    assert np.abs(ref - other).max() > 100 * np.abs(ref - logits).max()
