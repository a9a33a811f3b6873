"""Start from a Hugging Face OLMo 2/3 checkpoint: a folder `save_pretrained` wrote.

    replay train --preset tiny model.init_from=/path/to/hf_dir [model.d_model=... ...]

The folder holds `config.json` and the weights: one `model.safetensors`, or shards named by
`model.safetensors.index.json` (what `save_pretrained(..., max_shard_size=...)` writes). With
`model.init_from` set, the trainer's initial parameters are the checkpoint's, converted with
trainer/reference.py's name map, bit for bit (`initial_params`); the optimizer state, the step
and the dropout key start as without it. It is a pure function of (the folder's bytes, the
config): the config is not changed from the folder. Instead the folder's `config.json` must map
to the trainer's model config (`model_config`); where it does not, the one-line error lists the
overrides that make it so. `train_reference(cfg, ..., weights=FOLDER)` reads the same folder.

What is refused, in one line naming the config.json key or the tensor:
- a config.json the trainer cannot represent: another model_type, head_dim != hidden_size /
  num_attention_heads, biases, attention dropout, an activation other than silu, RoPE scaling
  (yarn, linear, ...), per-layer-type RoPE thetas that differ, a layer_types pattern other than
  "full every N-th layer";
- tied vs untied: a checkpoint with tie_word_embeddings=true has no lm_head.weight. The trainer
  can tie too (model.tied_embeddings=true, its head is the embedding), so such a checkpoint
  needs that; it is not untied by copying embed_tokens into a new lm_head, which would train
  another model than the checkpoint's without saying so. An untied checkpoint into a tied
  config is refused the same way (its lm_head.weight would be dropped);
- a tensor missing, unknown, of another shape than the config's, or of a dtype the parameter
  dtype would round (float32 into model.param_dtype=bfloat16); bfloat16 or float16 into float32
  is exact and allowed.

Keys that do not change the function the weights compute in training are not mapped:
pad/bos/eos token ids (the trainer has no padding; the reference is built without a
padding_idx), max_position_embeddings, initializer_range, dtype, use_cache. Neither is seq_len.
Safetensors are read by this module (numpy and ml_dtypes, so bfloat16 reads), no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from trainer import reference
from trainer.config import ConfigError, ModelConfig

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MODEL_TYPES = ("olmo2", "olmo3")


class CheckpointError(ConfigError):
    """A checkpoint the trainer cannot start from (its config.json, its files, a tensor): exit 2."""


# ------------------------------------------------------------------------------ config.json

# (trainer field, config.json key) in the order the differences are listed.
KEYS = (("vocab_size", "vocab_size"), ("d_model", "hidden_size"), ("n_layers", "num_hidden_layers"),
        ("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"), ("d_ff", "intermediate_size"),
        ("rope_theta", "rope_theta"), ("norm_eps", "rms_norm_eps"), ("tied_embeddings", "tie_word_embeddings"),
        ("qk_norm", "model_type"), ("sliding_window", "sliding_window"),
        ("full_attention_every", "layer_types"))


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {CONFIG}: give the folder save_pretrained wrote") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} is not a JSON object; the checkpoint is damaged")
    return d


def _refuse(key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"config.json {key}={json.dumps(value)}: {why}")


def _rope_theta(d: Mapping[str, Any]) -> float:
    """One theta from either layout: transformers 5's `rope_parameters` (flat, or per layer type)
    or the older top-level `rope_theta` with `rope_scaling`."""
    scaling = d.get("rope_scaling")
    if scaling and (not isinstance(scaling, Mapping)
                    or (scaling.get("rope_type") or scaling.get("type") or "default") != "default"):
        raise _refuse("rope_scaling", scaling, "the trainer's RoPE is the default one (no scaling); not supported")
    params = d.get("rope_parameters")
    if params is None:
        return float(d.get("rope_theta", 10_000.0))
    if not isinstance(params, Mapping):
        raise _refuse("rope_parameters", params, "want an object with rope_type and rope_theta")
    per_type = {k: v for k, v in params.items() if isinstance(v, Mapping)} or {"": params}
    thetas = set()
    for kind, p in per_type.items():
        key = "rope_parameters" + (f".{kind}" if kind else "")
        if (p.get("rope_type") or "default") != "default":
            raise _refuse(f"{key}.rope_type", p.get("rope_type"), "the trainer's RoPE is the default one (no "
                          "scaling); not supported")
        thetas.add(float(p.get("rope_theta", 10_000.0)))
    if len(thetas) > 1:
        raise _refuse("rope_parameters", params, "the trainer has one rope_theta for every layer")
    return thetas.pop()


def _window(d: Mapping[str, Any], n_layers: int, base: ModelConfig) -> dict[str, int]:
    """sliding_window and full_attention_every from OLMo 3's layer_types (trainer/attention.py's
    rule: block i is full when (i + 1) % N == 0)."""
    if d.get("model_type") != "olmo3":
        return {"sliding_window": 0, "full_attention_every": base.full_attention_every}
    types = d.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                     for i in range(n_layers)]  # Olmo3Config's default
    if len(types) != n_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise _refuse("layer_types", types, f"want {n_layers} of full_attention / sliding_attention")
    if "sliding_attention" not in types:
        return {"sliding_window": 0, "full_attention_every": base.full_attention_every}
    every = types.index("full_attention") + 1 if "full_attention" in types else n_layers + 1
    if any((t == "full_attention") != ((i + 1) % every == 0) for i, t in enumerate(types)):
        raise _refuse("layer_types", types, "the trainer's pattern is one full-attention layer every N "
                      "(model.full_attention_every), the others sliding")
    window = d.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise _refuse("sliding_window", window, "sliding layers need a positive window")
    return {"sliding_window": window, "full_attention_every": every}


def model_config(d: Mapping[str, Any], base: ModelConfig = ModelConfig()) -> ModelConfig:
    """`base` with every field config.json `d` sets; CheckpointError for what the trainer cannot be."""
    kind = d.get("model_type")
    if kind not in MODEL_TYPES:
        raise _refuse("model_type", kind, f"the trainer is OLMo 2/3 ({', '.join(MODEL_TYPES)})")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("attention_dropout", 0.0)):
        if d.get(key, ok) != ok:
            raise _refuse(key, d[key], f"the trainer has {json.dumps(ok)} only")
    try:
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        fields = dict(vocab_size=int(d["vocab_size"]), d_model=hidden, n_layers=int(d["num_hidden_layers"]),
                      n_heads=heads, n_kv_heads=int(d.get("num_key_value_heads") or heads),
                      d_ff=int(d["intermediate_size"]), norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                      tied_embeddings=bool(d.get("tie_word_embeddings", False)), qk_norm=True)
    except KeyError as e:
        raise CheckpointError(f"config.json has no {e.args[0]}; the checkpoint is damaged") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json has a value of the wrong type ({e})") from None
    if d.get("head_dim") not in (None, hidden // heads):
        raise _refuse("head_dim", d["head_dim"], f"the trainer's head_dim is hidden_size / num_attention_heads "
                      f"= {hidden // heads}")
    fields["rope_theta"] = _rope_theta(d)
    fields.update(_window(d, fields["n_layers"], base))
    try:
        return dataclasses.replace(base, **fields)
    except ConfigError as e:
        raise CheckpointError(f"config.json maps to a trainer config it refuses: {e}") from None


def overrides(m: ModelConfig, want: ModelConfig) -> list[str]:
    """The model.FIELD=value overrides that make `m` the mapped config `want`."""
    return [f"model.{f}={str(getattr(want, f)).lower() if isinstance(getattr(want, f), bool) else getattr(want, f)}"
            for f, _ in KEYS if _differs(m, want, f)]


def _differs(m: ModelConfig, want: ModelConfig, field: str) -> bool:
    if field == "full_attention_every" and not want.sliding_window:
        return False  # unused without sliding layers
    return getattr(m, field) != getattr(want, field)


def check_config(folder: str | Path, m: ModelConfig) -> None:
    """CheckpointError unless the folder's config.json maps to `m` (the fields KEYS lists)."""
    want = model_config(read_config(folder), m)
    if m.tied_embeddings != want.tied_embeddings:
        raise _tie_error(folder, m.tied_embeddings)
    diff = [(f, k) for f, k in KEYS if _differs(m, want, f)]
    if diff:
        shown = ", ".join(f"{k} gives {getattr(want, f)} (model.{f}={getattr(m, f)})" for f, k in diff)
        raise CheckpointError(f"{Path(folder) / CONFIG} does not match the trainer config: {shown}; set "
                              f"{' '.join(overrides(m, want))}")


def _tie_error(where: str | Path, trainer_tied: bool) -> CheckpointError:
    if trainer_tied:
        return CheckpointError(f"{where} has lm_head.weight (untied embeddings) but model.tied_embeddings=true has "
                               "no lm_head: set model.tied_embeddings=false to start from it")
    return CheckpointError(f"{where} has no lm_head.weight (tied embeddings: the head is embed_tokens) but "
                           "the trainer's lm_head.kernel is untied (model.tied_embeddings=false): set "
                           "model.tied_embeddings=true to train it tied")


# ------------------------------------------------------------------------------ safetensors

_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # jax's own dependency: numpy has no bfloat16

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header {name: {dtype, shape, data_offsets}} and where the data starts."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError("truncated header")
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except (OSError, ValueError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a safetensors file ({e}); the checkpoint is damaged") from None
    for name, t in header.items():
        try:
            dtype = _DTYPES.get(t["dtype"])
            begin, end = t["data_offsets"]
            fits = end - begin == math.prod(t["shape"]) * _np_dtype(dtype or "uint8").itemsize and 8 + n + end <= size
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{name} in {path} has no readable dtype, shape and offsets; the checkpoint is "
                                  "damaged") from None
        if dtype is None:
            raise CheckpointError(f"{name} in {path} is {t['dtype']}: the trainer's parameters are floating point")
        if not fits:
            raise CheckpointError(f"{name} in {path} is truncated or its size does not match its shape "
                                  f"{t['shape']}; the checkpoint is damaged")
    return header, 8 + n


def tensor_files(path: str | Path) -> dict[str, Path]:
    """{HF tensor name: the safetensors file holding it}: a .safetensors file, or a folder with
    model.safetensors (preferred, as transformers does) or the index and its shards."""
    p = Path(path)
    if p.is_file():
        return {name: p for name in _header(p)[0]}
    if not p.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder or safetensors file")
    if (p / SINGLE).is_file():
        return {name: p / SINGLE for name in _header(p / SINGLE)[0]}
    if not (p / INDEX).is_file():
        raise CheckpointError(f"{path} has neither {SINGLE} nor {INDEX}: give the folder save_pretrained wrote")
    try:
        weight_map = json.loads((p / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{p / INDEX} has no readable weight_map ({e}); the checkpoint is damaged") from None
    out: dict[str, Path] = {}
    for shard in sorted(set(weight_map.values())):
        held = _header(p / shard)[0]
        for name in (n for n, s in weight_map.items() if s == shard):
            if name not in held:
                raise CheckpointError(f"{INDEX} puts {name} in {shard}, which does not hold it; the checkpoint is damaged")
            out[name] = p / shard
    return out


def read_tensors(files: Mapping[str, Path], names: list[str] | None = None) -> dict[str, np.ndarray]:
    """The named tensors (default all), in their stored dtypes, each file read once."""
    by_file: dict[Path, list[str]] = {}
    for name in (list(files) if names is None else names):
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, np.ndarray] = {}
    for path, wanted in by_file.items():
        header, start = _header(path)
        with open(path, "rb") as f:
            for name in wanted:
                t = header[name]
                begin, end = t["data_offsets"]
                f.seek(start + begin)
                out[name] = np.frombuffer(f.read(end - begin), _np_dtype(_DTYPES[t["dtype"]])).reshape(t["shape"])
    return out


# ------------------------------------------------------------------------------ the weights

def hf_weights(path: str | Path, m: ModelConfig) -> dict[str, np.ndarray]:
    """The HF-named tensors of checkpoint `path` for the model `m`, checked: config.json (a
    folder), every parameter there with the config's shape, none unknown, a tied lm_head only as
    the embedding's exact copy. Stored dtypes are kept."""
    if Path(path).is_dir():
        check_config(path, m)
    files = tensor_files(path)
    wanted = [h for _, h, _ in reference.param_map(m)]
    headers = {f: _header(f)[0] for f in set(files.values())}
    if "lm_head.weight" in files and m.tied_embeddings \
            and not _same_bits(files, "lm_head.weight", "model.embed_tokens.weight"):
        raise _tie_error(path, True)  # an lm_head equal to the embedding is the tie written out: ignored
    if "lm_head.weight" not in files and not m.tied_embeddings:
        raise _tie_error(path, False)
    unknown = sorted(set(files) - set(wanted) - ({"lm_head.weight"} if m.tied_embeddings else set()))
    missing = [h for h in wanted if h not in files]
    if missing or unknown:
        raise CheckpointError(f"{path} does not fit the model config ({m.n_layers} layers, d_model {m.d_model}): "
                              f"missing {', '.join(missing[:3]) or 'none'}, unknown {', '.join(unknown[:3]) or 'none'}")
    shapes = reference.hf_shapes(m)
    for h in wanted:
        got = tuple(headers[files[h]][h]["shape"])
        if got != shapes[h]:
            raise CheckpointError(f"{h} in {files[h]} has shape {list(got)}, the config wants {list(shapes[h])}")
    return read_tensors(files, wanted)


def _same_bits(files: Mapping[str, Path], a: str, b: str) -> bool:
    return reference._same_bits(*read_tensors(files, [a, b]).values())


_WIDENS = {("bfloat16", "float32"), ("float16", "float32")}


def as_dtype(tensors: Mapping[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The tensors in `dtype`: the same bits, or a widening that keeps every value exactly; a
    narrowing (float32 into bfloat16) is refused, naming the tensor."""
    out = {}
    for name, a in tensors.items():
        have = str(a.dtype)
        if have != dtype and (have, dtype) not in _WIDENS:
            fix = "use model.param_dtype=float32" if have == "float32" else "convert the checkpoint to float32"
            raise CheckpointError(f"{name} is {have} in the checkpoint and model.param_dtype={dtype} would round "
                                  f"it: {fix}")
        out[name] = a if have == dtype else a.astype(_np_dtype(dtype))
    return out


def initial_params(m: ModelConfig) -> dict:
    """The trainer's parameter tree (numpy, model.param_dtype) from checkpoint m.init_from: what
    trainer.step.init_state starts from when it is set. Reads the files on every call."""
    if not m.init_from:
        raise CheckpointError("model.init_from is not set")
    tensors = as_dtype(hf_weights(m.init_from, m), m.param_dtype)
    return reference.to_jax(tensors, m)
