"""The trainer's model and its PyTorch reference: Hugging Face transformers' OLMo, both ways.

The reference is the OLMo implementation that ships with `transformers` (OLMo 3 where the
installed version has it, else OLMo 2), built at the trainer's sizes with random weights:
nothing is downloaded. Weights move between the two through safetensors, the format the
published checkpoints use, under one name map that is also the map between the two runs'
trace names (`tensor_names`): a torch run recorded with it names its tensors as the JAX run
does, in the JAX layouts, so bisect pairs them by name.

Where the two are the same function (measured by trainer/reference_parity.py; per-token KL of
the logits <= 1e-6 in float32 is the bar), and where they are not:

- same: OLMo-2's reordered norm (x + norm(f(x)), no pre-norm), QK-norm over the whole q and k
  projections (not per head), rotate-half RoPE with float32 tables, GQA's head grouping
  (HF's repeat_kv), SwiGLU, the final norm and an untied lm_head; scale head_dim ** -0.5.
- OLMo 3's sliding-window layers (3 in 4, window 4096) equal full attention for sequences up to
  4096 tokens (a query sees keys q-4095..q), which covers every preset; longer ones are refused.
- the reference has no dropout on the residual branches (only on attention probabilities), so
  model.dropout must be 0; nor a per-block dtype (model.bf16_block, a fault); nor a model
  without QK-norm (model.qk_norm=false is no OLMo 2/3).
- initialization differs and is not converted: HF draws N(0, initializer_range) untruncated,
  the trainer (as OLMo's own trainer) N(0, 0.02) truncated at 3 std. Runs compared start from
  the same weights, converted one way or the other.
- nn.Embedding(padding_idx=pad_token_id) would zero that row and never update it; the
  reference is built with pad_token_id=None, as the trainer has no padding.

Torch, transformers and safetensors are imported only by the functions that need them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from replay.record.names import get_path as _get
from trainer.config import Config, ConfigError, ModelConfig

SLIDING_WINDOW = 4096  # OLMo 3's


class ReferenceConfigError(ConfigError):
    """A trainer config the reference model cannot be (dropout, no QK-norm, a window OLMo 2 lacks)."""


def _m(cfg: Config | ModelConfig) -> ModelConfig:
    return cfg.model if isinstance(cfg, Config) else cfg


def generation() -> str:
    """"olmo3" when the installed transformers has it, else "olmo2"."""
    try:
        from transformers import Olmo3Config  # noqa: F401
        return "olmo3"
    except ImportError:
        return "olmo2"


def check(cfg: Config | ModelConfig) -> ModelConfig:
    m = _m(cfg)
    if m.dropout:
        raise ReferenceConfigError(f"model.dropout={m.dropout}: the OLMo reference has no residual dropout; "
                                   "use model.dropout=0 to compare against it")
    if m.bf16_block >= 0:
        raise ReferenceConfigError("model.bf16_block is a fault (one block in bfloat16); the reference has no such "
                                   "option: leave it at -1")
    if not m.qk_norm:
        raise ReferenceConfigError("model.qk_norm=false: OLMo 2 and 3 normalise q and k; use model.qk_norm=true")
    if m.sliding_window and generation() != "olmo3":
        raise ReferenceConfigError(f"model.sliding_window={m.sliding_window}: this transformers has OLMo 2 (no "
                                   "sliding-window layers); use model.sliding_window=0, or a transformers with OLMo 3")
    return m


def layer_types(cfg: Config | ModelConfig) -> list[str]:
    """OLMo 3's per-layer attention types of the trainer's model (trainer/attention.py's rule: with
    model.sliding_window, block i is full when (i + 1) % full_attention_every == 0; without, all full)."""
    m = _m(cfg)
    return ["sliding_attention" if m.sliding_window and (i + 1) % m.full_attention_every else "full_attention"
            for i in range(m.n_layers)]


# ------------------------------------------------------------------------------ the name map

def _block_names(m: ModelConfig) -> list[str]:
    width = max(2, len(str(m.n_layers - 1)))  # trainer/model.py's block_names
    return [f"block_{i:0{width}d}" for i in range(m.n_layers)]


def param_map(cfg: Config | ModelConfig) -> list[tuple[str, str, bool]]:
    """(trainer parameter, HF parameter, transposed) for every parameter, in the trainer's
    execution order (trainer.model.param_names). Dense kernels are [in, out], torch Linear
    weights [out, in]: those are transposed; embeddings and norm scales are not."""
    m = _m(cfg)
    out = [("embed.embedding", "model.embed_tokens.weight", False)]
    for i, b in enumerate(_block_names(m)):
        hf = f"model.layers.{i}"
        out += [(f"{b}.attn.{x}.kernel", f"{hf}.self_attn.{x}_proj.weight", True) for x in ("q", "k", "v")]
        if m.qk_norm:
            out += [(f"{b}.attn.{x}_norm.scale", f"{hf}.self_attn.{x}_norm.weight", False) for x in ("q", "k")]
        out += [(f"{b}.attn.o.kernel", f"{hf}.self_attn.o_proj.weight", True),
                (f"{b}.attn_norm.scale", f"{hf}.post_attention_layernorm.weight", False)]
        out += [(f"{b}.mlp.{x}.kernel", f"{hf}.mlp.{x}_proj.weight", True) for x in ("gate", "up", "down")]
        out += [(f"{b}.mlp_norm.scale", f"{hf}.post_feedforward_layernorm.weight", False)]
    out.append(("final_norm.scale", "model.norm.weight", False))
    if not m.tied_embeddings:
        out.append(("lm_head.kernel", "lm_head.weight", True))
    return out


def layer_map(cfg: Config | ModelConfig) -> list[tuple[str, str]]:
    """(trainer layer, HF module) for trainer.model.layer_names, in execution order: the module
    whose output is the trainer's layer-level tensor (a block's "attn" is the normed branch as
    added to the residual, i.e. post_attention_layernorm's output)."""
    m = _m(cfg)
    out = [("embed", "model.embed_tokens")]
    for i, b in enumerate(_block_names(m)):
        hf = f"model.layers.{i}"
        out += [(f"{b}.attn", f"{hf}.post_attention_layernorm"), (f"{b}.mlp", f"{hf}.post_feedforward_layernorm"),
                (b, hf)]
    return out + [("final_norm", "model.norm"), ("logits", "lm_head")]


def fine_map(cfg: Config | ModelConfig, block: str) -> list[tuple[str, str]]:
    """(trainer intermediate, HF module) for those of trainer.model.block_capture_names(block) that
    are a module's output in the reference (RoPE, scores, probabilities and context are not)."""
    m = _m(cfg)
    i = _block_names(m).index(block)
    hf = f"model.layers.{i}"
    attn = [("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")]
    attn += [("q_norm", "q_norm"), ("k_norm", "k_norm")] if m.qk_norm else []
    out = [(f"{block}.attn.{a}", f"{hf}.self_attn.{h}") for a, h in attn + [("out", "o_proj")]]
    out.append((f"{block}.attn_norm", f"{hf}.post_attention_layernorm"))
    out += [(f"{block}.mlp.{a}", f"{hf}.mlp.{a}_proj") for a in ("gate", "up", "down")]
    return out + [(f"{block}.mlp_norm", f"{hf}.post_feedforward_layernorm"), (block, hf)]


# Where the reference shows each point of trainer.model_names.block_capture_names(block) that no
# module returns: the attention function's arguments and result (transformers' eager attention:
# query and key after RoPE, the probabilities), and a module's input (the merged heads entering
# o_proj, SwiGLU's product entering down_proj). The scores before softmax are not shown.
_ATTENTION_POINTS = ("q_rope", "k_rope", "probs")
_INPUT_POINTS = {"attn.ctx": "self_attn.o_proj", "mlp.act": "mlp.down_proj"}


def fine_points(cfg: Config | ModelConfig, block: str) -> list[tuple[str, str, str]]:
    """(trainer intermediate, HF module, what of it: "out" its output, "in" its input, or
    "q_rope" / "k_rope" / "probs" of its attention call) for every point inside `block` the
    reference can show, in the trainer's execution order (the block's layer-level names too)."""
    from trainer.model_names import block_capture_names

    m = _m(cfg)
    hf = f"model.layers.{_block_names(m).index(block)}"
    modules = dict(fine_map(m, block))
    modules.update({f"{block}.attn": f"{hf}.post_attention_layernorm", f"{block}.mlp": f"{hf}.post_feedforward_layernorm"})
    out = []
    for name in block_capture_names(m, block):
        leaf = name[len(block) + 1:]
        if name in modules:
            out.append((name, modules[name], "out"))
        elif leaf in _INPUT_POINTS:
            out.append((name, f"{hf}.{_INPUT_POINTS[leaf]}", "in"))
        elif leaf.startswith("attn.") and leaf[5:] in _ATTENTION_POINTS:
            out.append((name, f"{hf}.self_attn", leaf[5:]))
    return out


# What each point computes, for a report ("block_00.attn.q_rope" -> by its last part).
OP_TEXT = {"q": "q projection", "k": "k projection", "v": "v projection", "q_norm": "QK-norm of q",
           "k_norm": "QK-norm of k", "q_rope": "rotary embedding of q", "k_rope": "rotary embedding of k",
           "probs": "attention softmax", "ctx": "attention context (heads merged)", "out": "o projection",
           "attn_norm": "attention branch norm", "gate": "gate projection", "up": "up projection",
           "act": "SwiGLU (silu(gate) * up)", "down": "down projection", "mlp_norm": "MLP branch norm",
           "embed": "token embedding", "final_norm": "final norm", "logits": "head (lm_head)"}


def op_text(name: str) -> str:
    """What the point `name` (a layer or a point inside a block) computes, in words."""
    parts = name.split(".")
    if len(parts) == 1 and parts[0].startswith("block_"):
        return "the block's residual sum"
    if len(parts) == 2 and parts[0].startswith("block_") and parts[1] in ("attn", "mlp"):
        return f"{'attention' if parts[1] == 'attn' else 'MLP'} branch as added to the residual"
    return OP_TEXT.get(parts[-1], name)


def tensor_names(cfg: Config | ModelConfig) -> Any:
    """The replay.torch TensorNames that records the reference under the trainer's trace names
    and layouts (imports torch)."""
    from replay.torch.names import ParamName, TensorNames

    params = tuple(ParamName(j, h, (1, 0) if t else None) for j, h, t in param_map(cfg))
    return TensorNames(params=params, layers=tuple(layer_map(cfg)), source=f"trainer.reference:{generation()}")


# ------------------------------------------------------------------------------ conversion

def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def to_jax(hf: Mapping[str, np.ndarray], cfg: Config | ModelConfig) -> dict:
    """The trainer's parameter tree (nested dict of numpy arrays) from HF-named tensors."""
    m = _m(cfg)
    known = {h for _, h, _ in param_map(m)}
    if m.tied_embeddings and "lm_head.weight" in hf and not _same_bits(hf["lm_head.weight"],
                                                                        hf.get("model.embed_tokens.weight")):
        raise ReferenceConfigError("the HF tensors have an lm_head.weight of its own (untied) but "
                                   "model.tied_embeddings=true has no lm_head: use model.tied_embeddings=false")
    known |= {"lm_head.weight"} if m.tied_embeddings else set()  # the tie written out: the embedding's copy
    extra = sorted(set(hf) - known)
    missing = [h for _, h, _ in param_map(m) if h not in hf]
    if extra or missing:
        raise ReferenceConfigError(f"the HF tensors do not fit model config {m.n_layers} layers, d_model "
                                   f"{m.d_model}: missing {', '.join(missing[:3]) or 'none'}, unknown "
                                   f"{', '.join(extra[:3]) or 'none'}; convert with the config they were made for")
    params: dict = {}
    for jax_name, hf_name, transposed in param_map(m):
        a = np.asarray(hf[hf_name])
        _set(params, jax_name, np.ascontiguousarray(a.T) if transposed else a)
    _check_shapes(params, m)
    return params


def _same_bits(a: Any, b: Any) -> bool:
    if b is None:
        return False
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def to_hf(params: Mapping[str, Any], cfg: Config | ModelConfig) -> dict[str, np.ndarray]:
    """HF-named tensors from the trainer's parameter tree (a tied lm_head is left to HF to tie)."""
    m = _m(cfg)
    host = {j: np.asarray(_get(params, j)) for j, _, _ in param_map(m)}
    _check_shapes(params, m)
    return {h: np.ascontiguousarray(host[j].T) if t else host[j] for j, h, t in param_map(m)}


def jax_shapes(cfg: Config | ModelConfig) -> dict[str, tuple[int, ...]]:
    """{trainer parameter: its shape} for every parameter of the config."""
    m = _m(cfg)
    D, F, V, NH, KH = m.d_model, m.d_ff, m.vocab_size, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    want = {"embed.embedding": (V, D), "final_norm.scale": (D,), "lm_head.kernel": (D, V)}
    for b in _block_names(m):
        want.update({f"{b}.attn.q.kernel": (D, NH), f"{b}.attn.k.kernel": (D, KH), f"{b}.attn.v.kernel": (D, KH),
                     f"{b}.attn.q_norm.scale": (NH,), f"{b}.attn.k_norm.scale": (KH,), f"{b}.attn.o.kernel": (NH, D),
                     f"{b}.attn_norm.scale": (D,), f"{b}.mlp.gate.kernel": (D, F), f"{b}.mlp.up.kernel": (D, F),
                     f"{b}.mlp.down.kernel": (F, D), f"{b}.mlp_norm.scale": (D,)})
    return {j: want[j] for j, _, _ in param_map(m)}


def hf_shapes(cfg: Config | ModelConfig) -> dict[str, tuple[int, ...]]:
    """{HF parameter: its shape} (torch Linear weights are [out, in])."""
    want = jax_shapes(cfg)
    return {h: want[j][::-1] if t else want[j] for j, h, t in param_map(cfg)}


def _check_shapes(params: Mapping[str, Any], m: ModelConfig) -> None:
    want = jax_shapes(m)
    for j, _, _ in param_map(m):
        shape = tuple(np.shape(_get(params, j)))
        if shape != want[j]:
            raise ReferenceConfigError(f"parameter {j} has shape {list(shape)}, the config says {list(want[j])}; "
                                       "convert with the config the weights were made for")


def flat_jax(params: Mapping[str, Any], cfg: Config | ModelConfig) -> dict[str, np.ndarray]:
    """{"block_00.attn.q.kernel": array, ...}: the trainer's tree flattened by dotted names."""
    return {j: np.asarray(_get(params, j)) for j, _, _ in param_map(cfg)}


def nested_jax(flat: Mapping[str, np.ndarray], cfg: Config | ModelConfig) -> dict:
    params: dict = {}
    for j, _, _ in param_map(cfg):
        if j not in flat:
            raise ReferenceConfigError(f"the trainer tensors lack {j}; convert with the config they were made for")
        _set(params, j, np.asarray(flat[j]))
    _check_shapes(params, _m(cfg))
    return params


# ------------------------------------------------------------------------------ files and models

def save_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def hf_config(cfg: Config | ModelConfig) -> Any:
    """The transformers config of the reference at the trainer's sizes (eager attention, float32)."""
    m = check(cfg)
    import transformers

    gen = generation()
    cls = transformers.Olmo3Config if gen == "olmo3" else transformers.Olmo2Config
    kwargs = dict(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
                  num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads,
                  hidden_act="silu", max_position_embeddings=max(m.seq_len, SLIDING_WINDOW),
                  initializer_range=m.init_std, tie_word_embeddings=m.tied_embeddings, rms_norm_eps=m.norm_eps,
                  attention_bias=False, attention_dropout=0.0, pad_token_id=None, bos_token_id=None,
                  eos_token_id=None, use_cache=False)
    if gen == "olmo3":
        # The trainer's window and layer pattern, not Olmo3Config's defaults (4096; 3 sliding, 1 full):
        # without them the reference is another function past 4096 tokens or with another pattern.
        kwargs["sliding_window"] = m.sliding_window or SLIDING_WINDOW  # unused when every layer is full
        kwargs["layer_types"] = layer_types(m)
        kwargs["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": m.rope_theta}
                                     for t in ("sliding_attention", "full_attention")}
    else:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": m.rope_theta}
    config = cls(**kwargs)
    config._attn_implementation = "eager"
    return config


def hf_model(cfg: Config | ModelConfig, seed: int = 0) -> Any:
    """The reference OLMoForCausalLM, random weights from torch seed `seed`, float32, eval mode."""
    import torch
    import transformers

    config = hf_config(cfg)
    cls = transformers.Olmo3ForCausalLM if generation() == "olmo3" else transformers.Olmo2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(torch.float32).eval()


def hf_tensors(model: Any, cfg: Config | ModelConfig) -> dict[str, np.ndarray]:
    """The reference's parameters as HF-named numpy arrays (copies; a tied lm_head left out)."""
    state = model.state_dict()
    return {h: state[h].detach().cpu().numpy().copy() for _, h, _ in param_map(cfg)}


def load_into(model: Any, tensors: Mapping[str, np.ndarray], cfg: Config | ModelConfig) -> None:
    """Copies HF-named tensors into the reference's parameters, bit for bit."""
    import torch

    state = model.state_dict()
    with torch.no_grad():
        for _, h, _ in param_map(cfg):
            src = torch.from_numpy(np.array(tensors[h], copy=True))  # torch wants a writable buffer
            if tuple(src.shape) != tuple(state[h].shape):
                raise ReferenceConfigError(f"{h} has shape {list(src.shape)}, the reference {list(state[h].shape)}")
            state[h].copy_(src)
