"""The trainer's PyTorch reference (trainer/reference.py: Hugging Face OLMo at the trainer's sizes)
as `replay compare --eval` asks for it: replay.compare.sides.TorchReference, given to replay by the
trainer plugin's `torch_reference(run)` hook (trainer/plugin.py), for the trainer's own runs and
the replay.torch runs of its reference (trainer/reference_train.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from replay.engine.protocol import LEGACY_DEFAULT_FACTORY as TRAINER_FACTORY
from trainer.config import Config, ConfigError, from_dict
from trainer import port_bugs, reference


class TrainerReference:
    """The reference at a run's config: `cfg` (the trainer Config), `batch_size` (rows per forward
    pass: the run's global batch), `model()`, `load(model, weights)`, `weights(state)`; for
    bisect's op refinement (replay/bisect/cross_refine.py) `fine_forward(model, step, block)` and
    `op_text(name)`. `variant`: the held-out mistake the torch run was trained with
    (trainer.port_bugs.REFERENCE_BUGS, its manifest's "reference_bug"), patched into every model."""

    def __init__(self, cfg: Config, variant: str | None = None):
        self.cfg = cfg
        self.variant = variant
        self.batch_size = cfg.data.global_batch_size
        self._m = dataclasses.replace(cfg.model, dropout=0.0)  # evaluation: no dropout

    def model(self) -> Any:
        """A fresh reference model at the run's sizes, float32, eval mode (its weights are
        replaced by `load`)."""
        model = reference.hf_model(self._m)
        if self.variant:
            port_bugs.apply_reference_bug(model, self.variant)
        return model

    def fine_forward(self, model: Any, step: int, block: str) -> dict[str, np.ndarray]:
        """{trainer intermediate: float32 array in the trainer's layout} of the points inside `block`
        (trainer.reference.fine_points) that `model`'s forward shows, on the inputs of step `step`
        (the trainer's batch rows less their last token, as both sides feed them)."""
        import torch

        from trainer.reference_train import reference_rows

        tokens = torch.from_numpy(reference_rows(self.cfg, step)[:, :-1]).long()
        return capture(model, tokens, self._m, block)

    @staticmethod
    def op_text(name: str) -> str:
        return reference.op_text(name)

    def load(self, model: Any, weights: dict[str, np.ndarray]) -> None:
        """Copies weights under the reference's names into `model`, bit for bit."""
        reference.load_into(model, weights, self._m)

    def weights(self, state: Any) -> dict[str, np.ndarray]:
        """A JAX trainer state's parameters (as TrainerReplay.restore gives it) under the
        reference's names."""
        import jax

        return reference.to_hf(jax.tree.map(np.asarray, state.params), self.cfg)


def for_run(run: Any) -> TrainerReference | None:
    """The reference of a trainer run or of a replay.torch run of the trainer's reference (its
    config under "trainer_config"); None for any other run. A run that is one of these but whose
    config this version cannot read is a ConfigError (one line)."""
    manifest = run.manifest
    raw = manifest.get("config")
    torch = manifest.get("recorded_by") == "replay.torch"
    if torch:
        if not (isinstance(raw, dict) and "trainer_config" in raw):
            return None
        raw = raw["trainer_config"]
    elif manifest.get("replayable", TRAINER_FACTORY) != TRAINER_FACTORY:
        return None  # another loop's run
    variant = (manifest.get("config") or {}).get("reference_bug") if torch else None
    try:
        return TrainerReference(from_dict(raw), variant)
    except (ConfigError, TypeError, KeyError, AttributeError) as e:
        what = "a replay.torch run of trainer.reference" if torch else "a trainer run"
        raise ConfigError(f"{run.path}: its manifest config is not a trainer config this version reads ({e}), so "
                          f"compare --eval cannot rebuild its model; it compares trainer runs and their reference "
                          f"runs ({what} recorded with config=trainer.config.to_dict(cfg))") from None


def capture(model: Any, tokens: Any, m: Any, block: str) -> dict[str, np.ndarray]:
    """The points of `block` (trainer.reference.fine_points) in one forward of `model` on int64
    `tokens` [B, L]: module outputs and inputs through hooks, the attention points through a wrapper
    of transformers' eager attention function while the forward runs (none without it: another
    attention implementation, or a transformers that names it otherwise)."""
    import sys

    import torch

    N, K = m.n_heads, m.n_kv_heads
    layouts = {"q_rope": lambda t: t.transpose(1, 2).reshape(t.shape[0], t.shape[2], K, N // K, t.shape[3]),
               "k_rope": lambda t: t.transpose(1, 2), "probs": lambda t: t.unflatten(1, (K, N // K))}
    modules = dict(model.named_modules())
    got: dict[str, Any] = {}
    handles, attention = [], {}
    for name, path, what in reference.fine_points(m, block):
        if what in layouts:
            attention.setdefault(modules[path], []).append((name, what))
            continue

        def hook(module, args, out, name=name, what=what):
            t = args[0] if what == "in" else (out if isinstance(out, torch.Tensor) else out[0])
            got[name] = t.detach().float().cpu().numpy().copy()
        handles.append(modules[path].register_forward_hook(hook))
    owner = sys.modules[type(next(iter(attention))).__module__] if attention else None
    original = getattr(owner, "eager_attention_forward", None)
    eager = getattr(model.config, "_attn_implementation", None) == "eager"

    def wrapped(module, query, key, value, attention_mask, scaling, *args, **kwargs):
        out, weights = original(module, query, key, value, attention_mask, scaling, *args, **kwargs)
        seen = {"q_rope": query, "k_rope": key, "probs": weights}
        for name, what in attention.get(module, []):
            if seen[what] is not None:
                got[name] = layouts[what](seen[what].detach().float()).cpu().numpy().copy()
        return out, weights
    try:
        if original is not None and eager:
            owner.eager_attention_forward = wrapped
        with torch.no_grad():
            model(tokens)
    finally:
        if original is not None and eager:
            owner.eager_attention_forward = original
        for h in handles:
            h.remove()
    return {name: got[name] for name, _, _ in reference.fine_points(m, block) if name in got}
