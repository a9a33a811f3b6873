"""The named configurations: tiny and demo for this CPU, olmo-1b and olmo3-7b for accelerators.

`get_preset(name)` returns one (frozen; change it with trainer.config.apply_overrides). The
dataclasses are trainer/config.py's, which re-exports PRESETS and get_preset for its importers.
"""

from __future__ import annotations

from trainer.config import (CheckpointConfig, Config, ConfigError, DataConfig, MeshConfig, ModelConfig,
                            OptimizerConfig, TraceConfig)


def _tiny() -> Config:
    # Tests: compiles and steps in about a second on 2 CPU cores. GQA and dropout are on so
    # that tests exercise those paths (and the dropout key actually matters). Batch 16, not
    # 8: with one 32-token example per device XLA:CPU picks another matmul kernel for the
    # small k/v projections and 1 vs 8 devices differ; from 2 examples per device the
    # forward is bit-identical on 1, 2 and 8 devices (measured).
    return Config(
        seed=0, steps=20,
        model=ModelConfig(dropout=0.1),
        data=DataConfig(global_batch_size=16),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=5, decay_steps=20),
        checkpoint=CheckpointConfig(every_steps=10, keep=0),
        trace=TraceConfig(level="layer", layer_every=1),
    )


def _demo() -> Config:
    # CPU demo: 0.94M params learns the embedded English byte corpus visibly within a few
    # hundred steps. No dropout: the model is far too small to overfit ~0.5 MB in 1000 steps,
    # and dropout's random bits are a measurable cost on CPU.
    return Config(
        seed=0, steps=1000,
        model=ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=384,
                          seq_len=128, dropout=0.0),
        data=DataConfig(global_batch_size=16),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50, decay_steps=1000, z_loss=1e-4),
        checkpoint=CheckpointConfig(every_steps=100, keep=0),
        trace=TraceConfig(level="layer", layer_every=1),
    )


def _olmo(d_model: int, n_layers: int, n_heads: int, d_ff: int, lr: float, sliding_window: int = 0) -> Config:
    # OLMo-2/3 shapes for accelerators (not run here): dolma2 tokenizer (100278 ids padded
    # to 100352), 4096-token context, rope 500k, QK-norm, untied, bf16 activations with fp32
    # master weights, 1024 x 4096 = 4M tokens per step, FSDP over every device, fused attention
    # (mesh-invariant mode needs model.attention=explicit). OLMo 3's sliding-window layers (HF
    # Olmo3Config: window 4096, every 4th layer full) equal full attention at 4096 tokens; they
    # act from model.seq_len > 4096 (OLMo 3's 8k context, not the preset's default).
    return Config(
        seed=0, steps=1_000_000,
        model=ModelConfig(vocab_size=100_352, d_model=d_model, n_layers=n_layers,
                          n_heads=n_heads, n_kv_heads=n_heads, d_ff=d_ff, seq_len=4096,
                          rope_theta=500_000.0, dropout=0.0, tied_embeddings=False,
                          qk_norm=True, norm_eps=1e-6, dtype="bfloat16", param_dtype="float32",
                          attention="fused", sliding_window=sliding_window, full_attention_every=4),
        data=DataConfig(source="embedded:default", token_dtype="uint32", global_batch_size=1024),
        optimizer=OptimizerConfig(lr=lr, warmup_steps=2000, decay_steps=1_000_000,
                                  min_lr_ratio=0.1, weight_decay=0.1, b1=0.9, b2=0.95,
                                  eps=1e-8, grad_clip=1.0, z_loss=1e-5),
        mesh=MeshConfig(data=1, fsdp=-1),
        checkpoint=CheckpointConfig(every_steps=1000, keep=3),
        trace=TraceConfig(level="layer", layer_every=100),
    )


PRESETS: dict[str, Config] = {
    "tiny": _tiny(),
    "demo": _demo(),
    "olmo-1b": _olmo(d_model=2048, n_layers=16, n_heads=16, d_ff=8192, lr=4e-4),
    "olmo3-7b": _olmo(d_model=4096, n_layers=32, n_heads=32, d_ff=11008, lr=3e-4, sliding_window=4096),
}


def get_preset(name: str) -> Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]
