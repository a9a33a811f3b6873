"""check.replicas with model.scan_layers: the per-replica fingerprints a step records are the ones
`replay verify` recomputes (trainer/sdc.py replica_lanes), on every rotation of the work, and a
chip changes exactly the microbatches it computed. 4 virtual devices in a fresh process (set before
JAX starts): this file runs itself as the child (`python -m tests.trainer.test_sdc_scan OUT`).

One compiled verify program serves both halves: a chip starting at step 1 is inactive at step 0
(the step counter is traced), so step 0 is the clean computation and step 1 the faulty one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICES, CHIP = 4, 1


@pytest.mark.slow
def test_scan_layers_replicas_match_the_recomputation_and_a_chip_shows(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "tests.trainer.test_sdc_scan", str(tmp_path / "out.json")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["replica_tensors"] == 4 * 5  # 4 microbatches x (embed, block_00, block_01, final_norm, lm_head)
    assert got["recorded_equals_recomputed"] and got["rotations_agree"] == [True, True, True]
    from trainer.sdc import executor

    # the chip acts wherever device CHIP computes: its own microbatch unrotated, another one rotated
    assert got["chip_differs"] == {str(r): [mb for mb in range(4) if executor(mb, DEVICES, 4, r) == CHIP]
                                   for r in range(3)}


def _child(out: Path) -> None:
    from trainer import invariant

    invariant.prepare_process()
    import jax
    import numpy as np

    from trainer import loop, mesh as meshlib, rng, sdc, step as steplib
    from trainer.config import apply_overrides
    from trainer.presets import get_preset
    from trainer.faults import FaultPlan, parse

    cfg = apply_overrides(get_preset("tiny"), ["mesh.mesh_invariant=true", "mesh.n_microbatches=4",
                                               "check.replicas=true", "trace.level=layer", "model.scan_layers=true"])
    built = loop.build(cfg)
    state = meshlib.init_sharded_state(cfg, built.mesh)
    arrays, _ = built.device_batch(0)
    key = jax.random.key_data(rng.step_key(jax.random.wrap_key_data(state.key, impl="threefry2x32"), state.step))
    faulty = FaultPlan([parse(f"sdc-chip@1:device={CHIP}")], cfg).model_cfg(1)
    def recompute(params, key_data, step, rotate, batch):  # as replay/verify does
        step_key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
        return sdc.replica_lanes(params, faulty, batch, step_key, step, rotate, built.mesh)

    verify = jax.jit(recompute)
    lanes = {(s, r): np.asarray(verify(state.params, key, s, r, arrays)) for s in (0, 1) for r in range(3)}
    _, metrics = built.compiled["layer"](state, arrays)
    fps = np.asarray(jax.device_get(metrics["fingerprints"]))
    where = [i for i, (name, _) in enumerate(steplib.tensor_schema(cfg)) if name.startswith("replica/")]
    recorded = fps[where].reshape(lanes[0, 0].shape)
    out.write_text(json.dumps({
        "replica_tensors": len(where),
        "recorded_equals_recomputed": bool(np.array_equal(recorded, lanes[0, 0])),
        "rotations_agree": [bool(np.array_equal(lanes[0, r], recorded)) for r in range(3)],
        "chip_differs": {str(r): np.flatnonzero(np.any(lanes[1, r] != lanes[0, 0], axis=(1, 2))).tolist()
                         for r in range(3)},
    }))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
