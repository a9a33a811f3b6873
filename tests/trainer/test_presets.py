"""trainer/presets.py holds the presets; trainer/config.py keeps PRESETS and get_preset for its
importers, and either module may be imported first (presets.py imports config.py's classes)."""

import subprocess
import sys
from pathlib import Path

import pytest

from trainer import config, presets

ROOT = Path(__file__).resolve().parents[2]


def test_config_re_exports_the_presets_module_s_objects():
    assert config.PRESETS is presets.PRESETS
    assert config.get_preset("olmo3-7b") is presets.PRESETS["olmo3-7b"]
    with pytest.raises(config.ConfigError, match="valid presets: tiny, demo, olmo-1b, olmo3-7b"):
        config.get_preset("nope")
    with pytest.raises(AttributeError):
        config.NOT_A_NAME  # noqa: B018 (the module __getattr__ answers PRESETS only)


@pytest.mark.slow  # a fresh interpreter: the import order is the point
@pytest.mark.parametrize("first", ["trainer.presets", "trainer.config"])
def test_either_module_imports_first(first):
    code = f"import {first}; from trainer.config import PRESETS, get_preset; print(get_preset('tiny').model.d_model)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "64", out.stderr
