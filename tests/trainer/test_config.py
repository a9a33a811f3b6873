import dataclasses
import json

import pytest

from trainer.config import Config, ConfigError, MeshConfig, ModelConfig, apply_overrides, config_diff, flatten, from_dict, to_dict
from trainer.presets import PRESETS, get_preset


def test_presets_exist_and_have_expected_shapes():
    assert set(PRESETS) == {"tiny", "demo", "olmo-1b", "olmo3-7b"}
    for name in PRESETS:
        assert isinstance(get_preset(name), Config)
    tiny = get_preset("tiny").model
    assert (tiny.n_layers, tiny.d_model, tiny.seq_len, tiny.vocab_size) == (2, 64, 32, 320)
    m1, m7 = get_preset("olmo-1b").model, get_preset("olmo3-7b").model
    assert (m1.d_model, m1.n_layers, m1.n_heads, m1.d_ff) == (2048, 16, 16, 8192)
    assert (m7.d_model, m7.n_layers, m7.n_heads, m7.d_ff) == (4096, 32, 32, 11008)
    for m in (m1, m7):
        assert m.qk_norm and m.vocab_size == 100_352 and m.seq_len == 4096
    assert get_preset("olmo3-7b").data.token_dtype == "uint32"


def test_unknown_preset_is_one_line_listing_valid_names():
    with pytest.raises(ConfigError) as e:
        get_preset("gpt5")
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "\n" not in msg and "gpt5" in msg
    for name in PRESETS:
        assert name in msg


def test_overrides_parse_to_field_types_and_return_new_config():
    base = get_preset("tiny")
    cfg = apply_overrides(base, [
        "model.n_layers=4", "optimizer.lr=3e-4", "trace.level=step", "model.qk_norm=false",
        "model.tied_embeddings=True", "data.source=/tmp/tokens.bin", "seed=7", "steps=1e3",
        "model.dtype=bfloat16", "mesh.fsdp=-1", "mesh.data=1",
    ])
    assert cfg.model.n_layers == 4 and type(cfg.model.n_layers) is int
    assert cfg.optimizer.lr == 3e-4 and type(cfg.optimizer.lr) is float
    assert cfg.trace.level == "step"
    assert cfg.model.qk_norm is False and cfg.model.tied_embeddings is True
    assert cfg.data.source == "/tmp/tokens.bin"
    assert cfg.seed == 7 and cfg.steps == 1000
    assert cfg.model.dtype == "bfloat16" and cfg.mesh.fsdp == -1
    # The original is untouched and untouched sections are shared, not copied.
    assert base == get_preset("tiny") and base.model.n_layers == 2
    assert cfg.checkpoint is base.checkpoint
    # A float field accepts an integer literal.
    assert apply_overrides(base, ["optimizer.lr=1"]).optimizer.lr == 1.0


def test_later_override_wins():
    cfg = apply_overrides(get_preset("tiny"), ["model.n_layers=3", "model.n_layers=5"])
    assert cfg.model.n_layers == 5


@pytest.mark.parametrize("item, needle", [
    ("model.n_layer=4", "model.n_layer"),
    ("optimizer.learning_rate=1", "optimizer.learning_rate"),
    ("modle.d_model=8", "modle"),
    ("nonsense=1", "nonsense"),
])
def test_unknown_key_names_it_and_lists_valid_keys(item, needle):
    with pytest.raises(ConfigError) as e:
        apply_overrides(get_preset("tiny"), [item])
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    if item.startswith("model."):
        assert "model.n_layers" in msg and "model.d_model" in msg
    if item.startswith("optimizer."):
        assert "optimizer.lr" in msg
    if item.startswith("modle."):
        assert "model" in msg and "optimizer" in msg


@pytest.mark.parametrize("item", [
    "model.n_layers=four", "model.n_layers=2.5", "optimizer.lr=fast", "model.qk_norm=maybe",
    "trace.level=everything", "model.dtype=float16", "model", "model=3", "=3",
    "model.d_model=65",  # not divisible by n_heads
    "model.n_layers=0", "model.n_kv_heads=3", "model.dropout=1.0",
    "optimizer.warmup_steps=100",  # > decay_steps
    "mesh.data=-1", "mesh.fsdp=-1",  # data is already -1 in tiny: only one may be -1
    "mesh.data=0", "data.global_batch_size=0", "trace.layer_every=0",
    "model.vocab_size=70000",  # does not fit uint16 tokens
])
def test_bad_override_values_raise_config_error(item):
    cfg = get_preset("tiny")
    if item == "mesh.data=-1":
        cfg = apply_overrides(cfg, ["mesh.data=1", "mesh.fsdp=-1"])
    with pytest.raises(ConfigError) as e:
        apply_overrides(cfg, [item])
    assert "\n" not in str(e.value)


def test_validation_in_post_init():
    with pytest.raises(ConfigError):
        ModelConfig(d_model=64, n_heads=5)
    with pytest.raises(ConfigError):
        MeshConfig(data=-1, fsdp=-1)
    ModelConfig(d_model=64, n_heads=4, n_kv_heads=1)  # GQA / MQA is fine


def test_frozen():
    cfg = get_preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.n_layers = 9
    hash(cfg)  # hashable, so usable as a static jit argument


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_to_dict_from_dict_round_trip_exactly(name):
    cfg = apply_overrides(get_preset(name), ["optimizer.lr=0.1", "model.rope_theta=12345.678"])
    d = to_dict(cfg)
    assert from_dict(d) == cfg
    via_json = from_dict(json.loads(json.dumps(d)))
    assert via_json == cfg
    assert to_dict(via_json) == d
    assert all(type(flatten(via_json)[k]) is type(v) for k, v in flatten(cfg).items())


def test_from_dict_is_strict():
    d = to_dict(get_preset("tiny"))
    d["model"]["n_layer"] = 3
    with pytest.raises(ConfigError, match="model.n_layer"):
        from_dict(d)
    d = to_dict(get_preset("tiny"))
    del d["optimizer"]["lr"]
    with pytest.raises(ConfigError, match="optimizer.lr"):
        from_dict(d)
    d = to_dict(get_preset("tiny"))
    d["model"]["n_layers"] = "2"
    with pytest.raises(ConfigError):
        from_dict(d)
    d = to_dict(get_preset("tiny"))
    d["model"]["qk_norm"] = 1  # an int is not a bool in a manifest
    with pytest.raises(ConfigError):
        from_dict(d)


def test_config_diff():
    a = get_preset("tiny")
    assert config_diff(a, a) == []
    b = apply_overrides(a, ["model.n_layers=3", "seed=5", "trace.level=off"])
    assert config_diff(a, b) == [("seed", 0, 5), ("model.n_layers", 2, 3),
                                 ("trace.level", "layer", "off")]
    assert config_diff(b, a) == [("seed", 5, 0), ("model.n_layers", 3, 2),
                                 ("trace.level", "off", "layer")]
    assert len(flatten(a)) == len(config_diff(a, get_preset("olmo3-7b"))) + len(
        [k for k in flatten(a) if flatten(a)[k] == flatten(get_preset("olmo3-7b"))[k]])


def test_a_config_recorded_before_the_model_options_existed_reads_as_the_one_it_ran():
    """Runs recorded before the port-bug switches, attention, remat, scan and accumulation existed
    ran with the behaviour each default now names, so their manifests still load (as those
    defaults); a field whose absence has no one meaning (data.sampler) is still refused."""
    from trainer import config as c

    cfg = PRESETS["tiny"]
    old = c.to_dict(cfg)
    for section, added in c._ADDED_LATER.items():
        for key, value in added.items():
            assert getattr(getattr(cfg, section), key) == value  # what "absent" means is the default
            del old[section][key]
    assert c.from_dict(old) == cfg
    del old["data"]["sampler"]
    with pytest.raises(c.ConfigError, match="data.sampler"):
        c.from_dict(old)


def test_a_config_recorded_before_the_packed_record_reads_as_the_program_it_ran():
    """trace.packed_record changes the step's program, not its records: a manifest without it reads
    as false, the dict program such a run compiled (its program_hash holds), while new configs get
    the packed one (true)."""
    from trainer import config as c

    cfg = PRESETS["tiny"]
    assert cfg.trace.packed_record is True
    old = c.to_dict(cfg)
    del old["trace"]["packed_record"]
    assert c.from_dict(old) == dataclasses.replace(cfg, trace=dataclasses.replace(cfg.trace, packed_record=False))
