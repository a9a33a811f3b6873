"""Forward parity of the trainer's model and its torch reference on the same weights.

The measure MaxText's checker uses, tighter: per-token KL(reference || trainer) of the next-token
distributions and the largest absolute logit difference, in float32, on one long sequence
(short prompts hide RoPE bugs that only show at far positions), plus each layer-level tensor's
largest absolute difference, so a failure names the first layer that parts. Imports JAX, torch
and transformers. Cost: one forward pass of each model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trainer import reference
from trainer.config import Config, ModelConfig

KL_BAR = 1e-6  # issue 13's bar: 100x tighter than MaxText's 1e-4


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def token_kl(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(logits)) per token, in float64: [..., V] -> [...]."""
    lp, lq = _log_softmax64(ref_logits), _log_softmax64(logits)
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


def forward_parity(cfg: Config | ModelConfig, *, seq_len: int = 512, seed: int = 0, direction: str = "hf_to_jax",
                   corrupt: str | None = None) -> dict:
    """Both models on the same weights and the same `seq_len` random tokens.

    direction "hf_to_jax": the reference's random init converted into the trainer's model;
    "jax_to_hf": the trainer's init converted into the reference. corrupt: a trainer parameter
    name to transpose after conversion (square kernels only): a port bug the measure must catch.
    """
    import jax
    import jax.numpy as jnp
    import torch

    from trainer import model as jmodel

    m = dataclasses.replace(reference.check(cfg), seq_len=seq_len)
    hf = reference.hf_model(m, seed)
    if direction == "hf_to_jax":
        params = reference.to_jax(reference.hf_tensors(hf, m), m)
    elif direction == "jax_to_hf":
        params = jax.tree.map(np.asarray, jmodel.init_params(m, jax.random.key(seed)))
        reference.load_into(hf, reference.to_hf(params, m), m)
    else:
        raise ValueError(f"direction {direction!r} is not hf_to_jax or jax_to_hf")
    if corrupt is not None:
        leaf = reference._get(params, corrupt)
        reference._set(params, corrupt, np.ascontiguousarray(leaf.T))
    tokens = np.random.default_rng(seed).integers(0, m.vocab_size, size=(1, seq_len), dtype=np.int32)

    captured: dict[str, np.ndarray] = {}
    modules = dict(hf.named_modules())
    hooks = []
    for name, path in reference.layer_map(m):
        def hook(_mod, _args, out, name=name):
            t = out if isinstance(out, torch.Tensor) else out[0]
            captured[name] = t.detach().cpu().numpy()
        hooks.append(modules[path].register_forward_hook(hook))
    try:
        with torch.no_grad():
            ref_logits = hf(torch.from_numpy(tokens).long()).logits.float().numpy()
    finally:
        for h in hooks:
            h.remove()
    logits, layers = jmodel.apply(m, jax.tree.map(jnp.asarray, params), jnp.asarray(tokens), capture=True)
    logits = np.asarray(logits)
    kl = token_kl(ref_logits, logits)
    per_layer = {}
    for name in jmodel.layer_names(m):
        a, b = captured[name].astype(np.float64), np.asarray(layers[name]).astype(np.float64)
        per_layer[name] = {"max_abs_diff": float(np.abs(a - b).max()),
                           "rel_l2": float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))}
    return {"generation": reference.generation(), "direction": direction, "seq_len": seq_len,
            "max_token_kl": float(kl.max()), "mean_token_kl": float(kl.mean()),
            "max_abs_logit_diff": float(np.abs(ref_logits - logits).max()),
            "max_abs_logit": float(np.abs(ref_logits).max()), "layers": per_layer}
