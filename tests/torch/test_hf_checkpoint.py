"""Starting both sides from a Hugging Face OLMo checkpoint folder (trainer/hf_checkpoint.py): a
tiny OLMo 3 saved by transformers' own `save_pretrained` in shards (an index and >= 2 files) maps
to the trainer's config, becomes the trainer's initial params and the reference's weights bit
for bit, a tied checkpoint and a wrong shape are refused in one line naming the parameter, and a
tied/untied pair is bisected to the parameter one side lacks."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.cli_util import assert_one_line_error, invoke  # noqa: E402
from trainer import hf_checkpoint, reference  # noqa: E402
from trainer.config import apply_overrides  # noqa: E402
from trainer.presets import get_preset  # noqa: E402

BASE = dataclasses.replace(get_preset("tiny"), model=dataclasses.replace(get_preset("tiny").model, dropout=0.0))
# Not the preset's sizes, so the mapping has something to do; OLMo 3's sliding pattern, full every 3rd.
M = dataclasses.replace(BASE.model, n_layers=3, d_model=32, d_ff=96, rope_theta=500_000.0, norm_eps=1e-5,
                        sliding_window=8, full_attention_every=3)
FLIPPED = "model.layers.1.mlp.up_proj.weight"


def _save(m, folder, **kw):
    reference.hf_model(m, seed=1).save_pretrained(folder, **kw)
    return folder


def _rewrite(src, dst, name, change):
    """A copy of checkpoint `src` whose tensor `name` is `change(array)`, rewritten in its shard."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    shard = dst / json.loads((dst / hf_checkpoint.INDEX).read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = change(tensors[name].copy())
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


def _flip(a):
    a.view(np.uint32).flat[5] ^= 1  # the last mantissa bit of one element
    return a


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    sharded = _save(M, root / "sharded", max_shard_size="20KB")
    out = {"sharded": sharded, "single": _save(M, root / "single"),
           "tied": _save(dataclasses.replace(M, tied_embeddings=True), root / "tied", max_shard_size="20KB"),
           "flipped": _rewrite(sharded, root / "flipped", FLIPPED, _flip),
           "tensors": reference.hf_tensors(reference.hf_model(M, seed=1), M)}
    assert len(set(json.loads((sharded / hf_checkpoint.INDEX).read_text())["weight_map"].values())) >= 2
    assert not (sharded / hf_checkpoint.SINGLE).exists() and (out["single"] / hf_checkpoint.SINGLE).exists()
    return out


def _differing(hf_named: dict, want: dict) -> list[str]:
    assert set(hf_named) == set(want)
    return [h for h in want if np.asarray(hf_named[h]).tobytes() != want[h].tobytes()]


def _cfg(m, folder):
    return dataclasses.replace(BASE, model=dataclasses.replace(m, init_from=str(folder)))


# ------------------------------------------------------------------------------ config.json

def test_config_json_maps_to_the_trainer_config(ckpt):
    mapped = hf_checkpoint.model_config(hf_checkpoint.read_config(ckpt["sharded"]), BASE.model)
    assert mapped == M
    hf_checkpoint.check_config(ckpt["sharded"], M)
    with pytest.raises(hf_checkpoint.CheckpointError) as e:
        hf_checkpoint.check_config(ckpt["sharded"], BASE.model)
    line = str(e.value)
    assert "\n" not in line and "hidden_size gives 32 (model.d_model=64)" in line
    fixed = apply_overrides(BASE, line.split("; set ")[1].split())  # the error's own overrides fix it
    assert fixed.model == M
    # The older layout (rope_theta at the top, rope_scaling null), as OLMo 2 checkpoints were published.
    olmo2 = {"model_type": "olmo2", "vocab_size": 100352, "hidden_size": 2048, "num_hidden_layers": 16,
             "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 8192, "hidden_act": "silu",
             "rms_norm_eps": 1e-6, "rope_theta": 500000, "rope_scaling": None, "tie_word_embeddings": False,
             "attention_bias": False, "attention_dropout": 0.0, "pad_token_id": 100277}
    m2 = hf_checkpoint.model_config(olmo2, BASE.model)
    assert (m2.d_model, m2.n_layers, m2.n_heads, m2.d_ff, m2.rope_theta, m2.vocab_size, m2.sliding_window) == \
        (2048, 16, 16, 8192, 500000.0, 100352, 0)


@pytest.mark.parametrize("key, value", [
    ("model_type", "llama"), ("rope_scaling", {"rope_type": "yarn", "factor": 8.0}), ("head_dim", 16),
    ("layer_types", ["full_attention", "sliding_attention", "sliding_attention"]), ("attention_bias", True),
    ("hidden_act", "gelu")])
def test_what_the_trainer_cannot_be_is_refused_naming_the_key(ckpt, key, value):
    d = {**hf_checkpoint.read_config(ckpt["sharded"]), key: value}
    with pytest.raises(hf_checkpoint.CheckpointError) as e:
        hf_checkpoint.model_config(d, BASE.model)
    assert str(e.value).startswith(f"config.json {key}=") and "\n" not in str(e.value)


def _train_args(m, folder, out):
    sets = hf_checkpoint.overrides(BASE.model, m) + ["model.dropout=0", f"model.init_from={folder}"]
    return ["train", "--preset", "tiny", "--out", str(out), "--steps", "1", *(a for s in sets for a in ("--set", s))]


def test_the_cli_refuses_a_config_json_it_cannot_represent(ckpt, tmp_path):
    bad = shutil.copytree(ckpt["sharded"], tmp_path / "yarn")
    d = json.loads((bad / "config.json").read_text())
    d["rope_parameters"]["full_attention"]["rope_type"] = "yarn"
    (bad / "config.json").write_text(json.dumps(d))
    assert_one_line_error(invoke(*_train_args(M, bad, tmp_path / "run")), "rope_parameters.full_attention.rope_type")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ the JAX side

def test_the_trainers_initial_params_are_the_checkpoints(ckpt, tmp_path):
    import jax

    from trainer import mesh, optim, step

    def initial(folder, sharded=False):
        cfg = _cfg(M, folder)
        state = mesh.init_sharded_state(cfg, mesh.make_mesh(cfg.mesh)) if sharded else step.init_state(cfg)
        return state, reference.to_hf(jax.tree.map(np.asarray, state.params), M)

    state, hf = initial(ckpt["sharded"])
    assert _differing(hf, ckpt["tensors"]) == []
    assert _differing(initial(ckpt["sharded"], sharded=True)[1], ckpt["tensors"]) == []  # the loop's init
    assert _differing(initial(ckpt["single"])[1], ckpt["tensors"]) == []
    assert _differing(initial(ckpt["flipped"])[1], ckpt["tensors"]) == [FLIPPED]  # the comparison sees one bit
    fresh = optim.make_optimizer(BASE.optimizer).init(state.params)  # the optimizer starts fresh
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), state.opt_state, fresh))
    assert int(state.step) == 0
    # A pure function of the folder's bytes: the same path holding other weights gives those.
    moved = shutil.copytree(ckpt["sharded"], tmp_path / "moved")
    assert _differing(initial(moved, sharded=True)[1], ckpt["tensors"]) == []
    shutil.rmtree(moved)
    shutil.copytree(ckpt["flipped"], moved)
    assert _differing(initial(moved, sharded=True)[1], ckpt["tensors"]) == [FLIPPED]


def test_a_shape_mismatch_is_one_line_naming_the_parameter(ckpt, tmp_path):
    bad = _rewrite(ckpt["sharded"], tmp_path / "bad", FLIPPED, lambda a: a[:-1])
    r = invoke(*_train_args(M, bad, tmp_path / "run"))
    assert_one_line_error(r, FLIPPED, f"[{M.d_ff - 1}, {M.d_model}]", f"[{M.d_ff}, {M.d_model}]")


def test_a_tied_checkpoint_needs_a_tied_trainer_and_says_which_parameter_is_missing(ckpt, tmp_path):
    import jax

    from trainer import step

    r = invoke(*_train_args(M, ckpt["tied"], tmp_path / "run"))  # the trainer's lm_head is untied
    assert_one_line_error(r, "lm_head.weight", "model.tied_embeddings=true")
    tied = dataclasses.replace(M, tied_embeddings=True)
    params = step.init_state(_cfg(tied, ckpt["tied"])).params
    assert "lm_head" not in params  # the head is the embedding, as in the checkpoint
    want = reference.hf_tensors(reference.hf_model(tied, seed=1), tied)
    assert _differing(reference.to_hf(jax.tree.map(np.asarray, params), tied), want) == []
    with pytest.raises(hf_checkpoint.CheckpointError, match="lm_head.weight"):  # untied into tied
        step.init_state(_cfg(tied, ckpt["sharded"]))
    with pytest.raises(reference.ReferenceConfigError, match="lm_head.weight"):  # never dropped silently
        reference.to_jax(ckpt["tensors"], tied)
    written_out = {**want, "lm_head.weight": want["model.embed_tokens.weight"]}  # the tie, saved as a copy
    assert _differing(reference.to_hf(reference.to_jax(written_out, tied), tied), want) == []


# ------------------------------------------------------------------------------ the reference side

def test_the_reference_starts_from_the_same_folder(ckpt, tmp_path):
    from replay.torch.checkpoint import read_model
    from trainer.reference_train import train_reference

    def weights(run):
        return {h: t.numpy() for h, t in read_model(run, 0).items() if h in ckpt["tensors"]}

    runs = {"init_from": train_reference(_cfg(M, ckpt["sharded"]), tmp_path / "a", 1),
            "file": train_reference(_cfg(M, ""), tmp_path / "b", 1,
                                    weights=ckpt["single"] / hf_checkpoint.SINGLE),
            "flipped": train_reference(_cfg(M, ""), tmp_path / "c", 1, weights=ckpt["flipped"])}
    assert _differing(weights(runs["init_from"]), ckpt["tensors"]) == []
    assert _differing(weights(runs["file"]), ckpt["tensors"]) == []
    assert _differing(weights(runs["flipped"]), ckpt["tensors"]) == [FLIPPED]
    with pytest.raises(hf_checkpoint.CheckpointError, match="lm_head.weight"):
        train_reference(_cfg(M, ""), tmp_path / "d", 1, weights=ckpt["tied"])


def test_bisect_names_the_parameter_one_side_lacks(tmp_path):
    """The demo's JAX port (untied) against a reference trained tied on the same batches: the
    initial parameters differ, and the report names lm_head.kernel, which the torch side lacks."""
    from tests.torch.reference_pair import demo_config, port_run
    from trainer.reference_train import train_reference

    cfg = demo_config()
    tied = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tied_embeddings=True))
    torch_run = train_reference(tied, tmp_path / "tied", 1)
    r = invoke("bisect", str(torch_run), str(port_run(None)), "--json")
    assert r.exit_code == 1, r.output
    report = json.loads(r.stdout)
    assert (report["first_step"], report["cause"], report["first_layer"]) == (0, "init", "lm_head.kernel")
    assert "lm_head.kernel is a parameter of the JAX run only" in report["cause_text"]


@pytest.mark.slow
def test_both_sides_started_from_the_folder_agree_on_the_initial_params(ckpt, tmp_path):
    """`replay train ... model.init_from=FOLDER` and the reference from the same folder: bisect
    finds the same data and the same initial-parameter fingerprint (bits) on both sides."""
    from trainer.config import from_dict
    from trainer.reference_train import train_reference
    from traces import Run

    r = invoke(*_train_args(M, ckpt["sharded"], tmp_path / "jax"))
    assert r.exit_code == 0, r.output
    cfg = from_dict(Run.open(tmp_path / "jax").manifest["config"])
    assert cfg.model.init_from == str(ckpt["sharded"])  # saved into the run
    train_reference(cfg, tmp_path / "torch", 1)
    report = json.loads(invoke("bisect", str(tmp_path / "torch"), str(tmp_path / "jax"), "--json").stdout)
    assert report["inputs"]["init"]["equal"] is True and report["inputs"]["data"]["equal"] is True
