"""Issue 33 part 3(c): MaxText's OLMo 3 against OLMo-core's OLMo 3, one tiny config, the same initial
weights, the same token rows, each recorded by its own integration; then `replay bisect` across them.

The two sides need two venvs (MaxText: Python 3.12, jax 0.12, no torch, built by tools/maxtext-env.sh, its
python $MT/bin/python below; OLMo-core: this package's `[olmo-core]` extra, torch), so each stage runs in
the one that has its framework and they meet only as files in DIR:

    python tools/olmo3_pair.py prepare DIR [--data-seed=S]   # torch venv: tokens, OLMo-core's init -> DIR/hf
    $MT/bin/python tools/olmo3_pair.py convert DIR           # MaxText venv: DIR/hf -> DIR/mt_params (orbax)
    $MT/bin/python tools/olmo3_pair.py maxtext DIR RUN [--steps=N] [k=v ...]   # MaxText's train.main, recorded
    python tools/olmo3_pair.py olmo-core DIR RUN [--steps=N] [--qk-norm-eps=E] [--keep-adam-count] [--no-rope-taps]
                                                 [--twin]    # OLMo-core's Trainer, recorded (ReplayCallback)
    replay bisect DIR/RUN_maxtext DIR/RUN_olmo_core [--floor twin:DIR/RUN_twin]

--twin: the OLMo-core run with one element of every parameter moved by one float32 ULP after loading
the initial weights (its config records it under "twin"): a rounding-level twin of the OLMo-core side,
whose distance to it is this config's own noise floor (replay/bisect/twin_floor.py).

The config both sides express (key by key: `olmo_core_model` and `maxtext_argv` below): OLMo-core's
olmo3_1M (4 layers, d_model 12, 4 heads of 4, no GQA, SwiGLU 256, QK-norm over all heads, post-norm
("reordered") blocks, untied head, RoPE theta 5e5, eps 1e-6) with windows [8, 8, 8, full], vocabulary
512, sequences of 16, global batch 4, AdamW(1e-3, 0.9, 0.95, 1e-8, wd 0.1), constant LR, no clipping.

Data: MaxText's olmo_grain shuffles the instances with its own seed mix (sha256, not OLMo-core's
`get_rng(seed + epoch)`), so OLMo-core reads, unshuffled, a second token file whose windows are the
MaxText file's in MaxText's epoch-0 order: both see the same rows at every step of the first epoch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

# 256 windows: 64 steps in the first epoch, the longest run where both loaders read the same rows
# (past it MaxText reshuffles with epoch 1's seed, OLMo-core reads its file again in order)
VOCAB, SEQ, BATCH, WINDOWS, STEPS = 512, 16, 4, 256, 24
LAYERS, D_MODEL, HEADS, HEAD_DIM, MLP, WINDOW, THETA, EPS = 4, 12, 4, 4, 256, 8, 500_000, 1e-6
LR, BETAS, ADAM_EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
SEED = 0
TWIN = "init: the first element of every parameter +1 float32 ULP"


def maxtext_order(n: int, seed: int = SEED, epoch: int = 0):
    """MaxText's olmo_grain epoch order (maxtext.input_pipeline.olmo_data_grain.OlmoIndexSampler,
    shuffle on, one shard): numpy's PCG64 permutation, stable across numpy versions."""
    import numpy as np

    digest = hashlib.sha256(f"olmo-shuffle:{int(seed)}:{int(epoch)}".encode("utf-8")).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little")).permutation(n)


# ---------------------------------------------------------------- OLMo-core side (the torch venv)

def olmo_core_model(qk_norm_eps: float | None = None):
    """OLMo-core's olmo3_1M as the pair runs it; `qk_norm_eps` set in its config: an injected port difference."""
    import torch
    from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
    from olmo_core.nn.transformer import TransformerConfig

    torch.manual_seed(SEED)
    config = TransformerConfig.olmo3_1M(
        vocab_size=VOCAB, attn_backend=AttentionBackendName.torch,  # flash_2 (the default) needs a GPU
        sliding_window=SlidingWindowAttentionConfig(pattern=[WINDOW] * 3 + [-1], force_full_attention_on_first_layer=False,
                                                    force_full_attention_on_last_layer=True))
    if qk_norm_eps is not None:
        config.block.sequence_mixer.qk_norm.eps = qk_norm_eps
    return config.build(init_device="cpu")


def olmo_core_module(qk_norm_eps: float | None = None):
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    return TransformerTrainModuleConfig(rank_microbatch_size=BATCH * SEQ, max_sequence_length=SEQ,
                                        optim=AdamWConfig(lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=WD)
                                        ).build(olmo_core_model(qk_norm_eps))


def rope_taps(model) -> None:
    """Each block's rotary module given two identity children, `q` and `k`, that its outputs pass through:
    replay.torch records a leaf module's tensor output, and OLMo-core's rotary returns the pair (q, k), so
    without them the rotary is not recorded (MaxText's side taps it as `blocks.I.attention.rope.q|k`,
    replay/maxtext/olmo_core_names.py). Parameterless: the weights and the numbers are unchanged."""
    import torch

    class RopeTaps(torch.nn.Module):
        def __init__(self, rope):
            super().__init__()
            self.inner, self.q, self.k = rope, torch.nn.Identity(), torch.nn.Identity()

        def forward(self, q, k, **kwargs):
            q, k = self.inner(q, k, **kwargs)
            return self.q(q), self.k(k)

        def __getattr__(self, name):  # anything else OLMo-core asks of its rotary (its buffers) goes to it
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self._modules["inner"], name)

    for block in model.blocks.values():
        if getattr(block.attention, "rope", None) is not None:
            block.attention.rope = RopeTaps(block.attention.rope)


def load_hf(module, hf_dir: Path) -> None:
    """The model's weights set from HF files (config.json + model.safetensors), OLMo-core's converter."""
    import torch
    import transformers
    from olmo_core.nn.hf.convert import convert_state_from_hf
    from safetensors.numpy import load_file

    config = transformers.Olmo3Config(**json.loads((hf_dir / "config.json").read_text()))
    state = convert_state_from_hf(config, {k: torch.from_numpy(v) for k, v in load_file(str(hf_dir / "model.safetensors")).items()})
    module.model.load_state_dict(state, strict=True)


def adam_from_zero():
    """An OLMo-core Callback undoing what torch's optimizer-state materialization does to AdamW before
    the first step (torch.distributed.checkpoint.state_dict's _init_optim_state: a zero-gradient, zero-LR
    step, reached through the train module's state_dict()): it advances every parameter's Adam `step`
    to 1, so the first real update uses step-2 bias correction, 0.735 x the step optax (MaxText) takes.
    Found by this pair (issue 33, 3c); `--keep-adam-count` records the fit without this fix."""
    import torch
    from olmo_core.train.callbacks import Callback

    class AdamFromZero(Callback):
        priority = 10  # before ReplayCallback's pre_step records the state entering the step

        def pre_step(self, batch):
            if self.trainer.global_step != 1:
                return
            for state in self.trainer.train_module.optim.state.values():
                step, m, v = state.get("step"), state.get("exp_avg"), state.get("exp_avg_sq")
                if step is not None and float(step) == 1 and not torch.count_nonzero(m) and not torch.count_nonzero(v):
                    step.zero_()

    return AdamFromZero()


def maxtext_layout(input_ids):
    """OLMo-core's token rows as MaxText's olmo_grain batch holds them (ShiftToInputsTargets), int32."""
    import torch

    ids = input_ids.to(torch.int32)
    b, n = ids.shape
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    seg = torch.ones_like(ids)
    tseg = seg.clone()
    tseg[:, -1] = 0
    pos = torch.arange(n, dtype=torch.int32).expand(b, n).contiguous()
    return {"inputs": ids, "inputs_position": pos, "inputs_segmentation": seg, "targets": targets,
            "targets_segmentation": tseg}


def recorder(run: Path, config: dict | None = None):
    """ReplayCallback hashing each example as MaxText's batch of the same row: replay.maxtext hashes
    the whole batch MaxText's step takes (inputs, targets, positions, segmentations), ReplayCallback
    `input_ids` alone, so equal rows would never pair. (Hook wanted in replay.maxtext instead: hash
    `inputs` only, or let run.step name the leaves to hash.) One rank only."""
    from replay.torch.olmo_core import ReplayCallback

    class MaxTextRows(ReplayCallback):
        def _global_rows(self, batch):
            return super()._global_rows({**batch, "input_ids": maxtext_layout(batch["input_ids"])})

    return MaxTextRows(str(run), config=config)


def prepare(root: Path, data_seed: int = SEED) -> None:
    """DIR/tokens_maxtext.npy (MaxText's file), DIR/tokens_olmo_core.npy (its windows in MaxText's order,
    raw uint16 as OLMo-core reads), DIR/hf (config.json + model.safetensors: OLMo-core's initial weights
    through OLMo-core's own HF converter). `data_seed` draws other tokens (the shuffle's seed stays SEED):
    another clean pair, for bench/cross_noise_pair.py to measure the floor on pairs the tests do not use."""
    import numpy as np
    from olmo_core.nn.hf.config import get_hf_config
    from olmo_core.nn.hf.convert import convert_state_to_hf
    from safetensors.numpy import save_file

    root.mkdir(parents=True, exist_ok=True)
    tokens = np.random.default_rng(data_seed).integers(1, VOCAB, size=(WINDOWS, SEQ), dtype=np.uint32)
    tokens.reshape(-1).tofile(root / "tokens_maxtext.npy")  # raw, no .npy header: see convert()
    tokens[maxtext_order(WINDOWS)].astype(np.uint16).reshape(-1).tofile(root / "tokens_olmo_core.npy")
    # The weights OLMo-core trains from: its train module re-initializes the model it is given
    # (init_weights: std 0.02, not nn.Embedding's N(0, 1)), so export them after that build.
    model = olmo_core_module().model
    hf_config = get_hf_config(model)
    state = convert_state_to_hf(hf_config, {k: v.detach() for k, v in model.state_dict().items()})
    (root / "hf").mkdir(exist_ok=True)
    (root / "hf" / "config.json").write_text(hf_config.to_json_string())
    save_file({k: v.float().numpy().copy() for k, v in state.items()}, str(root / "hf" / "model.safetensors"))
    print(json.dumps({"hf_tensors": sorted(state), "hf_config": json.loads(hf_config.to_json_string())}))


def olmo_core_fit(root: Path, name: str, steps: int = STEPS, keep_adam_count: bool = False,
                  qk_norm_eps: float | None = None, taps: bool = True, twin: bool = False) -> Path:
    """OLMo-core's own Trainer on DIR/tokens_olmo_core.npy, unshuffled, recorded into DIR/NAME.
    taps=False: the rotary not recorded (`--no-rope-taps`; what the bisect names without it). twin: the
    initial weights' first element of every parameter moved up by one ULP (`--twin`)."""
    import torch
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.train import Duration, TrainerConfig

    torch.set_num_threads(1)
    module = olmo_core_module(qk_norm_eps)
    load_hf(module, root / "hf")  # the same initial weights MaxText loads (converted from the same files)
    if twin:
        with torch.no_grad():
            for p in module.model.parameters():
                flat = p.view(-1)
                flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=p.dtype))
    if taps:
        rope_taps(module.model)
    tok = TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0)
    ds = NumpyFSLDatasetConfig(tokenizer=tok, paths=[str(root / "tokens_olmo_core.npy")], sequence_length=SEQ,
                               work_dir=str(root / "work")).build()
    ds.prepare()
    loader = NumpyDataLoaderConfig(global_batch_size=BATCH * SEQ, seed=SEED, work_dir=str(root / "work")).build(ds)
    loader.shuffle = False  # the file is already in MaxText's order
    config = TrainerConfig(save_folder=str(root / "olmo" / name), max_duration=Duration.steps(steps),
                           metrics_collect_interval=1000)
    if not keep_adam_count:
        config = config.with_callback("adam_from_zero", adam_from_zero())
    # What this run changes, as its replay config: a twin (--floor twin:PATH) must match its side's
    side = {"keep_adam_count": keep_adam_count, "qk_norm_eps": qk_norm_eps, "rope_taps": taps}
    config = config.with_callback("replay", recorder(root / name, {**side, "twin": TWIN} if twin else side))
    config.build(module, loader).fit()
    return root / name


# ---------------------------------------------------------------- MaxText side (its venv)

def maxtext_argv(root: Path, name: str, *extra: str, steps: int = STEPS) -> list[str]:
    import maxtext

    return [str(Path(maxtext.__file__).parent / "configs" / "base.yml"),
            "hardware=cpu", "skip_jax_distributed_system=true", "dataset_type=olmo_grain", "olmo_apply_ngram_filter=false",
            f"olmo_index_path={root / 'index.json'}", f"data_shuffle_seed={SEED}", f"steps={steps}",
            f"per_device_batch_size={BATCH}", f"max_target_length={SEQ}",
            "model_name=olmo3-7b", "override_model_config=true", f"base_num_decoder_layers={LAYERS}",
            "scan_layers=false",  # one module per layer: its outputs are tapped per layer (forward_taps.py)
            f"base_emb_dim={D_MODEL}", f"base_num_query_heads={HEADS}", f"base_num_kv_heads={HEADS}",
            f"head_dim={HEAD_DIM}", f"base_mlp_dim={MLP}", f"vocab_size={VOCAB}", f"sliding_window_size={WINDOW}",
            "rope_type=default", f"rope_max_timescale={THETA}", f"normalization_layer_epsilon={EPS}",
            "attention=dot_product", "dtype=float32", "weight_dtype=float32", "matmul_precision=highest",
            f"learning_rate={LR}", "warmup_steps_fraction=0", "learning_rate_final_fraction=1.0",
            f"adam_b1={BETAS[0]}", f"adam_b2={BETAS[1]}", f"adam_eps={ADAM_EPS}", f"adam_weight_decay={WD}",
            "gradient_clipping_threshold=0", "enable_checkpointing=false",
            f"load_parameters_path={root / 'mt_params' / '0' / 'items'}",
            f"run_name={name}", f"base_output_directory={root / 'maxtext-out'}", *extra]


def convert(root: Path) -> None:
    """DIR/hf -> DIR/mt_params/0/items with MaxText's own converter (to_maxtext.main, its OLMo 3 param
    mapping and hooks), told the tiny model's HF config instead of the 7B one it has built in."""
    import numpy as np
    import transformers
    from maxtext.checkpoint_conversion import to_maxtext
    from maxtext.input_pipeline.olmo_data import build_index, read_raw_metadata_from_path
    from maxtext.input_pipeline.olmo_data_grain import OlmoIndexSampler

    # Headerless, as AI2's files are: build_index's default reader wants an np.save header, but the
    # loader memmaps the file from byte 0, so a header-ful file is read 128 bytes (two windows) off.
    build_index([(str(root / "tokens_maxtext.npy"), "pair")], SEQ, tokenizer="none",
                header_reader=lambda p: read_raw_metadata_from_path(p, "uint32")).save(str(root / "index.json"))
    sampler = OlmoIndexSampler(total_instances=WINDOWS, seed=SEED, shard_index=0, shard_count=1)
    order = np.asarray(sampler.shard_indices(seed=SEED, epoch=0))
    if not np.array_equal(order, maxtext_order(WINDOWS)):
        raise SystemExit("error: MaxText's olmo_grain order is not the one tools/olmo3_pair.py reproduces")
    hf = json.loads((root / "hf" / "config.json").read_text())
    to_maxtext.HF_MODEL_CONFIGS["olmo3-7b"] = transformers.Olmo3Config(**hf)
    to_maxtext.save_weights_to_checkpoint = _save_params
    argv = [a for a in maxtext_argv(root, "convert") if not a.startswith(("load_parameters_path=", "base_output_directory="))]
    to_maxtext.main(argv + [f"base_output_directory={root / 'mt_params'}"], lazy_load_tensors=True,
                    hf_model_path=str(root / "hf"), save_dtype="float32", simulated_cpu_devices_count=1)


def _save_params(path: str, weights: dict, device_count: int, use_ocdbt: bool, use_zarr3: bool, config=None) -> None:
    """What maxtext's save_weights_to_checkpoint writes, as a plain dict: MaxText 0.2.5 hands Orbax's v1
    Checkpointer a flax TrainState, for which it has no handler (NoEntryError), so its converter cannot
    save. The layout is the one load_parameters_path reads: DIR/0/items/params/params/..."""
    from maxtext.common import checkpointing

    manager = checkpointing.create_orbax_checkpoint_manager(path, True, False, 1, use_ocdbt=use_ocdbt,
                                                            use_zarr3=use_zarr3)
    import jax

    params = weights if isinstance(weights, dict) and "params" in weights else {"params": weights}
    params = jax.tree_util.tree_map(jax.numpy.asarray, params)  # Orbax's v1 PyTreeHandler takes no numpy leaf
    checkpointing.save_checkpoint(manager, 0, {"params": params}, config=config)
    checkpointing.wait_until_finished(manager)


def maxtext_fit(root: Path, name: str, *extra: str, steps: int = STEPS) -> Path:
    """MaxText's train.main recorded with its module outputs tapped under OLMo-core's names and distance
    sketches of replay.torch's width, so `replay bisect` compares the two runs tensor by tensor."""
    from replay.maxtext import record
    from traces.sketch import DEFAULT_WIDTH

    return record(root / name, maxtext_argv(root, name, *extra, steps=steps), taps=["forward"], forward_names="olmo_core",
                  sketch_width=DEFAULT_WIDTH)


# What each stage reads, and the stage that writes it.
NEEDS = {"prepare": (), "convert": ("hf/config.json", "tokens_maxtext.npy"),
         "maxtext": ("index.json", "mt_params/0/items"), "olmo-core": ("hf/config.json", "tokens_olmo_core.npy")}
NEEDS_STAGE = {"hf/config.json": "prepare", "tokens_maxtext.npy": "prepare", "tokens_olmo_core.npy": "prepare",
               "index.json": "convert", "mt_params/0/items": "convert"}


def _options(args: list[str]) -> dict[str, int]:
    """--steps=N (the runs) and --data-seed=S (prepare) as ints; ValueError says what is wrong, in one line."""
    out = {}
    for a in args:
        for key in ("steps", "data-seed"):
            if a.startswith(f"--{key}="):
                try:
                    out[key] = int(a.split("=", 1)[1])
                except ValueError:
                    raise ValueError(f"--{key} takes an integer, not {a.split('=', 1)[1]!r}") from None
    if not 0 < out.get("steps", 1) <= WINDOWS // BATCH:  # past the first epoch the two loaders' orders part
        raise ValueError(f"--steps must be 1..{WINDOWS // BATCH} (one epoch of {WINDOWS} windows, {BATCH} a step)")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("prepare", "convert", "maxtext", "olmo-core"):
        print("usage: tools/olmo3_pair.py prepare DIR [--data-seed=S] | convert DIR | maxtext DIR RUN [--steps=N] [k=v ...]"
              " | olmo-core DIR RUN [--steps=N]",
              file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    if argv[0] in ("maxtext", "olmo-core") and len(argv) < 3:
        print(f"error: {argv[0]} needs the run's name: tools/olmo3_pair.py {argv[0]} DIR RUN", file=sys.stderr)
        return 2
    missing = [n for n in NEEDS[argv[0]] if not (root / n).exists()]
    if missing:
        print(f"error: {root / missing[0]} is missing: run the stage that makes it first ({NEEDS_STAGE[missing[0]]})",
              file=sys.stderr)
        return 2
    try:
        opts = _options(argv[3:] if argv[0] in ("maxtext", "olmo-core") else argv[2:])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rest = [a for a in argv[3:] if not a.startswith(("--steps=", "--data-seed="))]
    try:
        if argv[0] == "prepare":
            prepare(root, opts.get("data-seed", SEED))
        elif argv[0] == "convert":
            convert(root)
        elif argv[0] == "maxtext":
            os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
            maxtext_fit(root, argv[2], *rest, steps=opts.get("steps", STEPS))
        else:
            eps = next((float(a.split("=", 1)[1]) for a in rest if a.startswith("--qk-norm-eps=")), None)
            olmo_core_fit(root, argv[2], steps=opts.get("steps", STEPS), keep_adam_count="--keep-adam-count" in rest,
                          qk_norm_eps=eps, taps="--no-rope-taps" not in rest, twin="--twin" in rest)
    except ImportError as exc:  # each stage runs in the venv that has its framework
        venv = "the MaxText venv (tools/maxtext-env.sh)" if argv[0] in ("convert", "maxtext") else "a venv with torch and ai2-olmo-core"
        print(f"error: {argv[0]} needs {venv}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
