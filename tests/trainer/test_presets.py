"""trainer/presets.py holds the presets and is their one home: trainer/config.py (whose classes
presets.py builds them from) neither defines nor re-exports them, so the two modules import one way."""

import subprocess
import sys
from pathlib import Path

import pytest

from trainer import config, presets

ROOT = Path(__file__).resolve().parents[2]


def test_the_presets_live_in_presets_only():
    assert presets.get_preset("olmo3-7b") is presets.PRESETS["olmo3-7b"]
    with pytest.raises(config.ConfigError, match="valid presets: tiny, demo, olmo-1b, olmo3-7b"):
        presets.get_preset("nope")
    assert not hasattr(config, "PRESETS") and not hasattr(config, "get_preset")


@pytest.mark.slow  # a fresh interpreter: the import order is the point
@pytest.mark.parametrize("first", ["trainer.presets", "trainer.config"])
def test_either_module_imports_first(first):
    code = f"import {first}; from trainer.presets import PRESETS, get_preset; print(get_preset('tiny').model.d_model)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "64", out.stderr
