"""Train the PyTorch reference (transformers' OLMo) as the JAX trainer trains its model, recorded
with replay.torch: the PyTorch side of a cross-framework pair for `replay bisect TORCH JAX`.

    from trainer.reference_train import train_reference
    train_reference(cfg, "runs/ref", steps=100)          # from the trainer's own initial weights

What is the same as the trainer's step (trainer/step.py, trainer/optim.py), so that a correct
port differs only by floating-point rounding:

- weights: the trainer's initial parameters (`trainer.step.init_state(cfg)`), converted with
  trainer/reference.py (or HF tensors: `weights=` a safetensors file or a Hugging Face checkpoint
  folder, sharded or not, trainer/hf_checkpoint.py; model.init_from's folder when it is set);
- data: the trainer's batches by step (`trainer.data.Batcher`, the same seed), so the example
  hashes are equal row for row;
- loss: mean next-token cross-entropy plus `z_loss * mean(logsumexp(logits)^2)`;
- optimizer: AdamW with the trainer's b1, b2, eps (outside the square root, as torch),
  decoupled weight decay on parameters of rank > 1 only, global-norm clipping as optax's
  `clip_by_global_norm` (scaled by clip / norm when norm >= clip), and the learning rate of
  step k read from the trainer's own schedule (`trainer.optim.lr_schedule`), so lr bits agree.

Recorded at the layer level under the trainer's names (`trainer.reference.tensor_names`) with
distance sketches: loss, z_loss, grad_norm (before clipping), lr, param_norm (after the update).
Cost: one reference step per step, recorded; O(1) memory in the number of steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np

from trainer import reference
from trainer.config import Config, to_dict
from trainer import hf_checkpoint

__all__ = ["reference_rows", "train_reference"]


def reference_rows(cfg: Config, step: int, source: Any = None) -> np.ndarray:
    """int32 [B, L+1] token rows of the trainer's batch at `step` (what both sides feed)."""
    from trainer import data, rng

    if source is None:
        source = data.open_source(cfg.data.source, cfg.data.token_dtype, cfg.model.vocab_size)
    batcher = data.Batcher(source, cfg.model.seq_len, cfg.data.global_batch_size, rng.data_seed(cfg.seed),
                           sampler=cfg.data.sampler)
    return data.load_batch(source, batcher.global_ids(step), cfg.model.seq_len)


def _initial_hf(cfg: Config, weights: str | Path | None, start_params: Any) -> dict[str, np.ndarray]:
    if weights is None and start_params is None and cfg.model.init_from:
        weights = cfg.model.init_from  # the checkpoint the JAX side of this config starts from
    if weights is not None:  # a HF folder (sharded or not) or one safetensors file, checked against cfg
        return hf_checkpoint.as_dtype(hf_checkpoint.hf_weights(weights, cfg.model), "float32")  # the reference's
    if start_params is None:  # init_state(cfg).params, without compiling the optimizer's init
        from trainer import model, rng

        start_params = model.init_params(cfg.model, rng.init_key(cfg.seed))
    return reference.to_hf(start_params, cfg)


def train_reference(cfg: Config, run_dir: str | Path, steps: int, *, weights: str | Path | None = None,
                    start_params: Any = None, sketch_width: int | None = None,
                    on_step: Callable[[int, float], None] | None = None, variant: str | None = None) -> Path:
    """Train the reference for `steps` steps into the new run folder `run_dir`; returns its path.

    `weights`: a safetensors file of HF-named tensors or a Hugging Face checkpoint folder to start
    from; `start_params`: trainer params to convert; default the trainer's initial params for `cfg`
    (the checkpoint of model.init_from when it is set). Checkpoints (safetensors,
    replay/torch/checkpoint.py) at step 0, every `cfg.checkpoint.every_steps` and at the end, as
    the trainer saves them, so `replay compare --eval` can evaluate the same steps of both runs.
    `on_step(k, loss)` after each step (a progress display; reading the loss waits for the step).
    `variant`: a held-out port mistake patched into the reference (trainer.port_bugs.REFERENCE_BUGS),
    recorded in the manifest as "reference_bug" so a re-run of the run patches it again."""
    import torch

    import replay.torch
    from replay.torch import checkpoint as torch_checkpoint
    from trainer import data
    from trainer.optim import lr_schedule
    from traces.sketch import DEFAULT_WIDTH

    m = reference.check(cfg)
    o = cfg.optimizer
    torch.manual_seed(cfg.seed)
    model = reference.hf_model(m, seed=cfg.seed)
    reference.load_into(model, _initial_hf(cfg, weights, start_params), m)
    if variant:
        from trainer.port_bugs import apply_reference_bug

        apply_reference_bug(model, variant)
    model.train()
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=0.0, betas=(o.b1, o.b2), eps=o.eps)
    schedule = lr_schedule(o)
    source = data.open_source(cfg.data.source, cfg.data.token_dtype, m.vocab_size)
    config = {"trainer_config": to_dict(cfg), "data": source.describe(), "reference": reference.generation(),
              **({"reference_bug": variant} if variant else {})}
    run = replay.torch.init(run_dir, config=config, model=model, optimizer=opt, names=reference.tensor_names(m),
                            sketch_width=DEFAULT_WIDTH if sketch_width is None else sketch_width)
    params = list(model.parameters())
    every = cfg.checkpoint.every_steps
    if every and steps > 0:
        torch_checkpoint.save(run, model, opt)  # checkpoint 0, as trainer/loop.py saves one
    for k in range(steps):
        lr = float(np.float32(schedule(k)))  # the trainer's float32 schedule value for step k
        for group in opt.param_groups:
            group["lr"] = lr
        rows = torch.from_numpy(reference_rows(cfg, k, source)).long()
        with run.step(rows) as rec:
            logits = model(rows[:, :-1]).logits
            logz = torch.logsumexp(logits, dim=-1)
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, m.vocab_size), rows[:, 1:].reshape(-1))
            z_loss = o.z_loss * torch.mean(torch.square(logz))
            (ce + z_loss).backward()
            grad_norm = torch.sqrt(sum(torch.sum(torch.square(p.grad)) for p in params))
            if o.grad_clip > 0 and grad_norm >= o.grad_clip:  # optax clip_by_global_norm
                for p in params:
                    p.grad.div_(grad_norm).mul_(o.grad_clip)
            opt.step()
            with torch.no_grad():
                param_norm = torch.sqrt(sum(torch.sum(torch.square(p)) for p in params))
            rec.metrics(loss=ce, z_loss=z_loss, grad_norm=grad_norm, lr=torch.tensor(lr, dtype=torch.float32),
                        param_norm=param_norm)
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(k, float(ce.detach()))
        done = k + 1
        if done == steps or (every and done % every == 0):
            torch_checkpoint.save(run, model, opt)  # the state after `done` steps (flushes the trace first)
    run.finish()
    return Path(run_dir)


def jax_config(cfg: Config) -> Config:
    """The trainer config of the JAX side of a pair: what the reference supports (no dropout)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.0))
