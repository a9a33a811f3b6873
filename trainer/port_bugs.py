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
