"""bench/donation.py: which combinations it plans (pure: no compile here; `replay plan`'s donation
report is tested in tests/replay/test_cli_plan.py, the check itself in tests/trainer/test_donation.py)."""

import pytest

from bench.donation import combinations, main
from trainer.constants import TRACE_LEVELS


def test_every_level_and_every_option_is_planned_for_every_preset():
    for preset, other in (("tiny", "fused"), ("olmo3-7b", "explicit")):
        combos = combinations(preset)
        names = [name for name, _, _ in combos]
        assert names[:3] == [f"level-{level}" for level in TRACE_LEVELS] and len(set(names)) == len(names) == 10
        sets = {name: s for name, _, s in combos}
        assert sets["other-attention"] == [f"model.attention={other}"]  # the attention the preset does not use
        assert "mesh.mesh_invariant=true" in sets["mesh-invariant"]
        assert {"model.remat=full", "model.scan_layers=true", "model.dtype=bfloat16"} <= set(sets["remat-full+scan+bf16"])
        assert all(level == "step" for name, level, _ in combos if not name.startswith("level-"))


@pytest.mark.parametrize("argv, words", [(["--presets", "nope"], "unknown preset 'nope'"),
                                         (["--presets", ","], "names no preset"), (["--devices", "0"], "--devices 0")])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
