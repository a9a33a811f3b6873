"""Port bugs (issue 13): the ways a JAX port of OLMo commonly differs from the reference.

Each is a config switch whose default is the reference's behaviour (HF transformers' OLMo 3 and
torch.optim.AdamW), so a pair is "the reference from the clean config, the JAX trainer from the
clean config with one bug switched on". `with_bug(cfg, name)` is that second config; the table
says where bisect should find each one (first step, first tensor of the trace schema, kind).

Two bugs are values of ordinary fields rather than switches of their own: the RMSNorm epsilon
(`model.norm_eps`, which the reference is built with, so the bug is a JAX side built with the
other common value) and a missing z-loss (`optimizer.z_loss=0` on the JAX side while the
reference's loop adds the configured term: needs a clean config with z_loss > 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import Config, ConfigError, apply_overrides


@dataclass(frozen=True)
class PortBug:
    name: str
    what: str  # the bug, in words
    first_tensor: str  # the first tensor of the trace schema it changes (trainer.step.tensor_schema)
    kind: str  # that tensor's causal kind: forward, loss, backward, update


PORT_BUGS: dict[str, PortBug] = {b.name: b for b in (
    PortBug("rope", "RoPE pairs (2i, 2i+1) (interleaved) instead of (i, i+H/2) (rotate-half)",
            "block_00.attn", "forward"),
    PortBug("norm_eps", "RMSNorm epsilon 1e-5 where the reference has 1e-6 (or the other way)",
            "block_00.attn", "forward"),
    PortBug("qk_norm", "QK-norm statistics per head instead of over the full q / k projection",
            "block_00.attn", "forward"),
    PortBug("adam_eps", "AdamW epsilon inside the square root, m / sqrt(v + eps)",
            "param/embed.embedding", "update"),
    PortBug("z_loss", "the z-loss term left out of the loss", "z_loss", "loss"),
)}


def overrides(cfg: Config, name: str) -> list[str]:
    """The `section.field=value` overrides that turn the clean config into the buggy port."""
    if name not in PORT_BUGS:
        raise ConfigError(f"unknown port bug {name!r}; valid: {', '.join(PORT_BUGS)}")
    if name == "rope":
        return ["model.rope_style=interleaved"]
    if name == "norm_eps":
        return ["model.norm_eps=" + ("1e-06" if cfg.model.norm_eps == 1e-5 else "1e-05")]
    if name == "qk_norm":
        if not cfg.model.qk_norm:
            raise ConfigError("port bug qk_norm needs model.qk_norm=true in the clean config")
        return ["model.qk_norm_scope=head"]
    if name == "adam_eps":
        return ["optimizer.eps_placement=inside"]
    if cfg.optimizer.z_loss <= 0:  # z_loss
        raise ConfigError("port bug z_loss needs optimizer.z_loss > 0 in the clean config (e.g. 1e-4)")
    return ["optimizer.z_loss=0"]


def with_bug(cfg: Config, name: str) -> Config:
    """The clean config with port bug `name` switched on (the JAX side of a buggy pair)."""
    return apply_overrides(cfg, overrides(cfg, name))


# ------------------------------------------------------------------ the op each bug is named at

# The first point inside the layer (trainer.model_names.block_capture_names, or the layer itself
# outside a block) where each bug acts: cross-framework bisect's refinement should name it
# (replay/bisect/cross_refine.py). Every RMSNorm shares model.norm_eps, and QK-norm runs first.
# The update and loss bugs are named by the field itself (no op inside a layer): None.
PORT_BUG_OPS: dict[str, str | None] = {"rope": "block_00.attn.q_rope", "norm_eps": "block_00.attn.q_norm",
                                       "qk_norm": "block_00.attn.q_norm", "adam_eps": None, "z_loss": None}


# ------------------------------------------------------------------ held-out port mistakes

@dataclass(frozen=True)
class ReferenceBug:
    """A port mistake the JAX trainer has no switch for, put on the torch side of a pair instead:
    the reference model patched (`apply_reference_bug`), recorded in the torch run's manifest
    (trainer/reference_train.py `variant=`) so a re-run of that run patches it again. Distance
    is symmetric, so bisect must name the same op whichever side holds the mistake."""
    name: str
    what: str
    op: str  # the point bisect's refinement should name
    diagnosis: str | None = None  # the op's finer reading ("mask", "softmax scale"), if it gives one


REFERENCE_BUGS: dict[str, ReferenceBug] = {b.name: b for b in (
    ReferenceBug("softmax_scale", "attention scores scaled by 1/head_dim instead of 1/sqrt(head_dim)",
                 "block_00.attn.probs", "softmax scale"),
    ReferenceBug("causal_mask", "causal mask off by one: each query also sees the next key",
                 "block_00.attn.probs", "mask"),
    ReferenceBug("gate_up", "SwiGLU with gate and up swapped: silu(up(x)) * gate(x)", "block_00.mlp.act"),
    ReferenceBug("head_merge", "attention heads merged as [head_dim, heads] instead of [heads, head_dim] "
                 "before the output projection", "block_00.attn.ctx"),
    ReferenceBug("rope_theta", "RoPE base 500000 (OLMo 2's long-context value) where the model has 10000 "
                 "(or the other way)", "block_00.attn.q_rope"),
)}


def apply_reference_bug(model, name: str) -> None:
    """Patch the transformers OLMo model `model` (in place) with held-out mistake `name`."""
    import torch

    if name not in REFERENCE_BUGS:
        raise ConfigError(f"unknown reference bug {name!r}; valid: {', '.join(REFERENCE_BUGS)}")
    layers = model.model.layers
    if name == "softmax_scale":
        for layer in layers:
            layer.self_attn.scaling = layer.self_attn.head_dim ** -1.0
    elif name == "causal_mask":
        def see_next(module, args, kwargs):
            mask = kwargs.get("attention_mask")
            if mask is not None:  # eager: additive float [B, 1, L, S], 0 where a key is seen
                mask = mask.clone()
                i = torch.arange(mask.shape[-2] - 1)
                mask[..., i, i + 1] = 0
                kwargs["attention_mask"] = mask
            return args, kwargs
        for layer in layers:
            layer.self_attn.register_forward_pre_hook(see_next, with_kwargs=True)
    elif name == "gate_up":
        for layer in layers:
            mlp = layer.mlp
            mlp.forward = lambda x, mlp=mlp: mlp.down_proj(mlp.act_fn(mlp.up_proj(x)) * mlp.gate_proj(x))
    elif name == "head_merge":
        def heads_last(module, args):
            ctx, heads = args[0], module.in_features // module.head_dim
            merged = ctx.unflatten(-1, (heads, module.head_dim)).transpose(-1, -2).flatten(-2)
            return (merged, *args[1:])
        for layer in layers:
            layer.self_attn.o_proj.head_dim = layer.self_attn.head_dim
            layer.self_attn.o_proj.register_forward_pre_hook(heads_last)
    else:  # rope_theta: the tables every layer type reads (transformers' Olmo3RotaryEmbedding buffers)
        rotary = model.model.rotary_emb
        for kind in rotary.layer_types:
            theta = rotary.config.rope_parameters[kind]["rope_theta"]
            freq = getattr(rotary, f"{kind}_inv_freq")
            dim = 2 * freq.numel()
            other = 10_000.0 if theta == 500_000.0 else 500_000.0
            freq.copy_(1.0 / (other ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)))
