"""The names a model's outputs are recorded under, in execution order: the blocks, the
layer-level forward outputs (what traces record) and the intermediates inside one block. A
pure function of the model config: no JAX, no parameters (trainer/model.py captures them
under these names).
"""

from __future__ import annotations

from trainer.config import Config, ModelConfig


def model_cfg(cfg: Config | ModelConfig) -> ModelConfig:
    """The model section of a whole config (the name functions take either)."""
    return cfg.model if isinstance(cfg, Config) else cfg


def block_names(cfg: Config | ModelConfig) -> list[str]:
    """["block_00", "block_01", ...]; zero-padded so names sort in execution order."""
    m = model_cfg(cfg)
    width = max(2, len(str(m.n_layers - 1)))
    return [f"block_{i:0{width}d}" for i in range(m.n_layers)]


def layer_names(cfg: Config | ModelConfig) -> list[str]:
    """Names of the layer-level forward outputs, in execution order (what traces record)."""
    names = ["embed"]
    for b in block_names(cfg):
        names += [f"{b}.attn", f"{b}.mlp", b]
    return names + ["final_norm", "logits"]


def block_capture_names(cfg: Config | ModelConfig, block: str) -> list[str]:
    """Names of the intermediates inside one block, in execution order."""
    m = model_cfg(cfg)
    if block not in block_names(m):
        raise ValueError(f"unknown block {block!r}; valid: {', '.join(block_names(m))}")
    attn = ["q", "k", "v"] + (["q_norm", "k_norm"] if m.qk_norm else [])
    # the fused attention never materialises its scores and probabilities
    attn += ["q_rope", "k_rope"] + (["logits", "probs"] if m.attention == "explicit" else []) + ["ctx", "out"]
    names = [f"{block}.attn.{n}" for n in attn] + [f"{block}.attn_norm", f"{block}.attn"]
    names += [f"{block}.mlp.{n}" for n in ("gate", "up", "act", "down")]
    return names + [f"{block}.mlp_norm", f"{block}.mlp", block]
