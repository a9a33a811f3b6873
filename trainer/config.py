"""Run configuration: frozen dataclasses nested by concern, CLI overrides (presets: trainer/presets.py;
a field's values from text or JSON, and ConfigError: trainer/config_values.py).

A config is saved whole into the run manifest and compared on resume, so it must
round-trip exactly through JSON (`to_dict` / `from_dict`) and never change after a run
starts (frozen; `apply_overrides` returns a new object).

There is one root seed (`Config.seed`). The init, data and dropout streams are derived
from it by name elsewhere, so no section carries a seed of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.config_values import ConfigError, coerce, field_types, valid_keys


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int = 320  # byte tokenizer: 256 bytes + specials, padded to a multiple of 64
    d_model: int = 64  # residual stream width
    n_layers: int = 2  # transformer blocks; traces name them block_00.. in this order
    n_heads: int = 4  # query heads; head_dim = d_model // n_heads
    n_kv_heads: int = 2  # key/value heads (< n_heads is GQA); must divide n_heads
    d_ff: int = 192  # SwiGLU hidden width (about 8/3 * d_model, rounded for tiling)
    seq_len: int = 32  # tokens per example fed to the model (data cuts seq_len + 1)
    rope_theta: float = 10_000.0  # RoPE base; OLMo-2/3 use 500k for long context
    dropout: float = 0.0  # on each residual branch; its key is passed in, never hidden
    tied_embeddings: bool = False  # OLMo-2/3 untie; tying saves vocab * d_model params
    qk_norm: bool = True  # OLMo-2 RMSNorm on q and k projections, for stability
    norm_eps: float = 1e-6  # RMSNorm epsilon (OLMo-2 value)
    init_std: float = 0.02  # every weight ~ N(0, init_std) truncated at 3 std, as OLMo-2
    dtype: Literal["float32", "bfloat16"] = "float32"  # activations and matmul inputs
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # stored params (and optimizer)
    bf16_block: int = -1  # fault injection only (layer-bf16): this block computes in bfloat16; -1 none
    # Port-bug switches (issue 13): the default is the reference's (HF OLMo 3) behaviour; the other
    # value is a bug a port makes, so a JAX run can be set up as that buggy port and bisected.
    rope_style: Literal["rotate_half", "interleaved"] = "rotate_half"  # pairs (i, i+H/2) as HF, or (2i, 2i+1)
    qk_norm_scope: Literal["projection", "head"] = "projection"  # QK-norm statistics over all heads (OLMo) or each
    attention: Literal["explicit", "fused"] = "explicit"  # own softmax (fixed-order backward) or dot_product_attention
    sliding_window: int = 0  # OLMo 3: a sliding layer's query sees itself and the W-1 keys before; 0 = all layers full
    full_attention_every: int = 4  # with sliding_window: block i is full attention when (i + 1) % N == 0 (OLMo 3: 4)
    remat: Literal["none", "full", "dots"] = "none"  # recompute blocks in the backward: no, all, all but matmuls
    scan_layers: bool = False  # run the blocks as one lax.scan over stacked params; traces still name every layer
    loss_chunk: int = 0  # LM head + cross-entropy this many positions at a time (trainer/chunked_loss.py); 0 = all
    init_from: str = ""  # a Hugging Face OLMo 2/3 checkpoint folder: the initial params (trainer/hf_checkpoint.py)

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                  "d_ff", "seq_len", "rope_theta", "norm_eps", "init_std")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model={self.d_model} must be divisible by "
                              f"model.n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError(f"head_dim = d_model // n_heads = {self.d_model // self.n_heads}"
                              " must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} must be divisible by "
                              f"model.n_kv_heads={self.n_kv_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        _non_negative(self, "sliding_window", "loss_chunk")
        if self.loss_chunk and self.seq_len % self.loss_chunk:
            raise ConfigError(f"model.loss_chunk={self.loss_chunk} must divide model.seq_len={self.seq_len}")
        _positive(self, "full_attention_every")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = "embedded:default"  # "embedded:NAME" (ships in the package) or a token file
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # element type of the flat token file
    global_batch_size: int = 16  # examples per step over all hosts and devices
    # Which slots each host reads (trainer/order.py): "global" is the same on any host count;
    # "contiguous-per-host" is a real loader bug (batches change with the host count on resume).
    sampler: Literal["global", "contiguous-per-host"] = "global"

    def __post_init__(self) -> None:
        _positive(self, "global_batch_size")
        if not self.source:
            raise ConfigError("data.source must not be empty")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    warmup_steps: int = 5  # linear warmup from 0
    decay_steps: int = 20  # cosine end; apart from Config.steps so a longer resume keeps the schedule
    min_lr_ratio: float = 0.1  # final lr as a fraction of peak; held after decay_steps
    weight_decay: float = 0.1  # AdamW decoupled decay
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay (0.95 as OLMo, steadier than 0.999 for LMs)
    eps: float = 1e-8  # Adam denominator epsilon
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    z_loss: float = 0.0  # coefficient of log(Z)^2, keeps logits from drifting; 0 disables
    eps_placement: Literal["outside", "inside"] = "outside"  # m/(sqrt(v)+eps) as torch; inside: port bug m/sqrt(v+eps)
    microbatches: int = 1  # gradient accumulation: a step sums this many sequential microbatches' gradients

    def __post_init__(self) -> None:
        _positive(self, "lr", "decay_steps", "eps", "microbatches")
        _non_negative(self, "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip", "z_loss")
        if self.warmup_steps > self.decay_steps:
            raise ConfigError(f"optimizer.warmup_steps={self.warmup_steps} must be <= "
                              f"optimizer.decay_steps={self.decay_steps}")
        if self.min_lr_ratio > 1.0:
            raise ConfigError(f"optimizer.min_lr_ratio={self.min_lr_ratio} must be <= 1")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optimizer.{name}={getattr(self, name)} must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    data: int = -1  # data-parallel axis size; -1 = all devices the other axes leave
    fsdp: int = 1  # axis params and optimizer state are sharded over; -1 = all remaining
    mesh_invariant: bool = False  # fixed-order gradient reduction: same bits on any device count
    n_microbatches: int = 1  # global microbatches in mesh-invariant mode (fixes the sum order)

    def __post_init__(self) -> None:
        for name in ("data", "fsdp"):
            v = getattr(self, name)
            if v != -1 and v < 1:
                raise ConfigError(f"mesh.{name}={v} must be a positive size or -1")
        if self.data == -1 and self.fsdp == -1:
            raise ConfigError("at most one of mesh.data, mesh.fsdp may be -1")
        _positive(self, "n_microbatches")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 10  # save every N steps (and always at the end); 0 = only at the end
    keep: int = 3  # most recent checkpoints kept on disk; 0 = keep all

    def __post_init__(self) -> None:
        _non_negative(self, "every_steps", "keep")


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    level: Literal["off", "step", "layer"] = "layer"  # what each step records (trainer/step.py)
    layer_every: int = 1  # level=layer: layer fingerprints every N steps; step fields every step
    # level=layer: also each tensor's distance sketch (trainer/sketches.py), so bisect measures distances from
    # the trace alone; off by default: it costs ~1.5-2% of a demo step's CPU (trainer/sketches.py), not ~free
    sketches: bool = False
    # level=step/layer: the step returns its record as ONE uint32 vector (replay/record/packed.py, as run.step's):
    # one output buffer to dispatch and copy, not 7-11; same record bits; false: a dict, the program of older runs
    packed_record: bool = True

    def __post_init__(self) -> None:
        _positive(self, "layer_every")


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """Silent-data-corruption checks in training (mesh-invariant mode only; trainer/sdc.py)."""

    rerun_every: int = 0  # re-run one step in N on devices rotated along the data axis and compare; 0 off
    rotate: int = 1  # the rotation of that re-run: device d computes the microbatches of device d + rotate
    replicas: bool = False  # level layer: record each microbatch's gradient fingerprints ("replica/...")

    def __post_init__(self) -> None:
        _non_negative(self, "rerun_every")
        _positive(self, "rotate")


@dataclass(frozen=True, kw_only=True)
class Config:
    seed: int = 0  # the one root seed; init/data/dropout streams derive from it by name
    steps: int = 20  # total training steps of the run
    model: ModelConfig = field(default_factory=ModelConfig)  # architecture
    data: DataConfig = field(default_factory=DataConfig)  # what is fed, in which order
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # AdamW and schedule
    mesh: MeshConfig = field(default_factory=MeshConfig)  # device layout
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # orbax saves
    trace: TraceConfig = field(default_factory=TraceConfig)  # what is recorded
    check: CheckConfig = field(default_factory=CheckConfig)  # silent-data-corruption checks

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ConfigError(f"seed={self.seed} must be >= 0")
        _non_negative(self, "steps")
        limit = _TOKEN_LIMIT[self.data.token_dtype]
        if self.model.vocab_size > limit:
            raise ConfigError(f"model.vocab_size={self.model.vocab_size} does not fit "
                              f"data.token_dtype={self.data.token_dtype}; use uint32")


_TOKEN_LIMIT = {"uint16": 2**16, "uint32": 2**32}
SECTIONS: tuple[str, ...] = ("model", "data", "optimizer", "mesh", "checkpoint", "trace", "check")


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise ConfigError(f"{_section_of(obj)}{name}={getattr(obj, name)} must be > 0")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ConfigError(f"{_section_of(obj)}{name}={getattr(obj, name)} must be >= 0")


def _section_of(obj: Any) -> str:
    for section, cls in _SECTION_TYPES.items():
        if type(obj) is cls:
            return section + "."
    return ""


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
    "mesh": MeshConfig, "checkpoint": CheckpointConfig, "trace": TraceConfig,
    "check": CheckConfig,
}


# ----------------------------------------------------------------- overrides and dicts

def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """Return a new Config with "section.field=value" (or "seed=1", "steps=10") applied.

    All overrides are applied together and validated once, so coupled fields can change
    in any order ("mesh.fsdp=-1 mesh.data=1"); a later override of the same key wins."""
    top_changes: dict[str, Any] = {}
    section_changes: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        section, dot, name = key.partition(".")
        if not dot:
            top = field_types(Config)
            if key in SECTIONS:
                raise ConfigError(f"override {key!r} names a section; use {key}.FIELD=value")
            if key not in top:
                raise ConfigError(f"unknown config key {key!r}; valid top-level keys: "
                                  f"seed, steps, and sections {', '.join(SECTIONS)}")
            top_changes[key] = coerce(raw, top[key], key, text=True)
            continue
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r} in {key!r}; valid sections: "
                              f"{', '.join(SECTIONS)}")
        cls = _SECTION_TYPES[section]
        types = field_types(cls)
        if name not in types:
            raise ConfigError(f"unknown config key {key!r}; valid keys of {section}: "
                              f"{valid_keys(cls, section + '.')}")
        section_changes.setdefault(section, {})[name] = coerce(raw, types[name], key, text=True)
    for section, changes in section_changes.items():
        top_changes[section] = _replace(getattr(cfg, section), **changes)
    return _replace(cfg, **top_changes) if top_changes else cfg


def _replace(obj: Any, **changes: Any) -> Any:
    # dataclasses.replace re-runs __post_init__, so every override is validated.
    return dataclasses.replace(obj, **changes)


def to_dict(cfg: Config) -> dict[str, Any]:
    """Nested dict of plain JSON values (int, float, bool, str)."""
    return dataclasses.asdict(cfg)


def from_dict(d: dict[str, Any]) -> Config:
    """Inverse of to_dict. Strict: unknown or missing keys are errors, because a manifest
    read with silently filled-in defaults could claim a config the run never had."""
    if not isinstance(d, dict):
        raise ConfigError(f"config must be a dict, got {type(d).__name__}")
    top = field_types(Config)
    if "check" not in d:  # recorded before the SDC checks existed: it ran with none, i.e. the defaults
        d = {**d, "check": dataclasses.asdict(CheckConfig())}
    d = _fill_added_later(d)
    _check_keys(d, Config, "")
    kwargs: dict[str, Any] = {}
    for name, tp in top.items():
        if name in SECTIONS:
            sub = d[name]
            cls = _SECTION_TYPES[name]
            if not isinstance(sub, dict):
                raise ConfigError(f"config section {name!r} must be a dict")
            if name == "data" and "sampler" not in sub:
                raise ConfigError(_BEFORE_SAMPLER)
            _check_keys(sub, cls, name + ".")
            types = field_types(cls)
            kwargs[name] = cls(**{k: coerce(sub[k], t, f"{name}.{k}", text=False)
                                  for k, t in types.items()})
        else:
            kwargs[name] = coerce(d[name], tp, name, text=False)
    return Config(**kwargs)


# A config without data.sampler was recorded before the data order became a keyed Feistel
# permutation (trainer/order.py); this trainer would feed such a run other batches.
_BEFORE_SAMPLER = ("config is missing key 'data.sampler': the run was recorded by an older trainer whose data "
                   "order this version no longer produces; replay or resume it with the version that recorded it")


# Fields added after runs were first recorded, each with the value that is what the trainer did
# before the field existed (bit for bit: the defaults' results did not change when they were
# added), so an older manifest reads as the config it ran. A field whose absence cannot be read
# as one behaviour (data.sampler) is not here: such a run is refused instead.
_ADDED_LATER: dict[str, dict[str, Any]] = {
    "model": {"rope_style": "rotate_half", "qk_norm_scope": "projection", "attention": "explicit",
              "sliding_window": 0, "full_attention_every": 4, "remat": "none", "scan_layers": False,
              "loss_chunk": 0, "init_from": ""},
    "optimizer": {"eps_placement": "outside", "microbatches": 1},
    "trace": {"sketches": False},
}

# Fields that change the step's program but not its results, added with a default other than what
# the trainer did before: an older manifest reads as the program it ran, so a replay or resume of it
# compiles that program again and its recorded program_hash still holds (bit-exact expected).
_PROGRAM_BEFORE: dict[str, dict[str, Any]] = {
    "trace": {"packed_record": False},
}


def _fill_added_later(d: dict[str, Any]) -> dict[str, Any]:
    out = dict(d)
    for table in (_ADDED_LATER, _PROGRAM_BEFORE):
        for section, added in table.items():
            sub = out.get(section)
            if isinstance(sub, dict) and any(k not in sub for k in added):
                out[section] = {**{k: v for k, v in added.items() if k not in sub}, **sub}
    return out


def _check_keys(d: dict[str, Any], cls: type, prefix: str) -> None:
    want = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - want)
    missing = sorted(want - set(d))
    if unknown:
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}; valid keys: "
                          f"{valid_keys(cls, prefix)}")
    if missing:
        raise ConfigError(f"config is missing key {prefix + missing[0]!r}")


def flatten(cfg: Config) -> dict[str, Any]:
    """{"seed": 0, "model.d_model": 64, ...} in field order."""
    out: dict[str, Any] = {}
    for key, value in to_dict(cfg).items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def config_diff(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """[(dotted key, value in a, value in b)] for every field that differs, in field order."""
    fa, fb = flatten(a), flatten(b)
    return [(k, fa[k], fb[k]) for k in fa if fa[k] != fb[k] or type(fa[k]) is not type(fb[k])]
