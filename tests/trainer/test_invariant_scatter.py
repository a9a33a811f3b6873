"""Mesh-invariant mode's fixed-order reduce-scatter (trainer/invariant.py).

On a power-of-two device count the microbatches are strided over the devices and each scan
step's n gradients are reduce-scattered inside the scan (reduce_block; the tree over the steps
built online by tree_sums.Counter); on other counts the partial sums are reduce-scattered after
it (scattered_sum). The reduced shards are all-gathered (copies). Either must give the bits
of the previous implementation (consecutive microbatches, every device's partial sums
all-gathered: `gathered_sum`) on every layout where that one agreed, and hold less per device.
One process with 8 virtual CPU devices and the mesh-invariant settings (tests/trainer/
invariant_probe.py) compiles the microbatched gradient of `tiny` on meshes of 1, 2, 4 (also
2 x 2: the all_to_all over both mesh axes) and 8 devices, and reports exact digests and the
compiled programs' memory. Compared with: the previous implementation in the same process, a
reference recorded from it before the change (tests/trainer/fixtures/invariant_reference.json),
and an injected difference (another summation order after the same all_to_all), which the
comparison must catch. The same probe shows that the gradients are made of the fixed-order softmax
and RMSNorm VJPs (trainer/model.py): another summation order inside them, as correct, gives other
gradient bits and the same loss bits (test_invariant_claims.py shows in-process that the step calls
them at every call site). Whole training runs on 1, 8 and 2 x 2 devices are compared bit for bit by
tests/trainer/test_invariant_claims.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.invariant_probe import probe_env
from trainer import invariant

ROOT = Path(__file__).resolve().parents[2]
# One reference per machine it was recorded on (XLA:CPU's bits follow the CPU model), each from the
# previous implementation: invariant_reference.json (AMD EPYC, session 5), _intel_6_167.json
# (session 7: commit 0aec485's trainer run through this probe on an Intel Xeon) and _amd_25_17.json
# (session 10: commit c323c3c's gathered_sum and reduce-scatter, equal on every layout, on an AMD EPYC
# of another family).
REFERENCES = sorted((Path(__file__).parent / "fixtures").glob("invariant_reference*.json"))
SCATTER = ("scatter:1x1", "scatter:2x1", "scatter:4x1", "scatter:2x2", "scatter:8x1")


def bits(run: dict) -> tuple:
    return run["loss"], run["example_loss"], run["grads"]


@pytest.fixture(scope="module")
def probed() -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.trainer.invariant_probe"], cwd=ROOT, env=probe_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["pool"] == invariant.POOL_THREADS
    return report


@pytest.mark.slow
def test_reduce_scatter_gives_the_bits_of_the_all_gather_on_every_layout(probed):
    runs = probed["runs"]
    reference = bits(runs["gather:8x1"])
    assert len(reference[2]) == len(runs["scatter:1x1"]["grads"]) > 5
    for name in SCATTER + ("gather:2x1",):
        assert bits(runs[name]) == reference, name


@pytest.mark.slow
def test_reduce_scatter_gives_the_bits_recorded_from_the_previous_implementation(probed):
    from replay.record.environment import cpu_description

    import jaxlib

    cpu = cpu_description()
    here = {"jax": probed["jax"], "jaxlib": jaxlib.__version__, "cpu_model": cpu["cpu_model"], "cpu_isa": cpu["cpu_isa"]}
    references = [json.loads(p.read_text()) for p in REFERENCES]
    found = [s for s in references if s["machine"] == here]
    if not found:  # XLA:CPU's bits follow the CPU and the jaxlib build (JAX-NOTES.md)
        pytest.skip(f"no reference was recorded on this machine ({here}); references: "
                    f"{[s['machine']['cpu_model'] for s in references]}")
    stored = found[0]
    for name in SCATTER:
        assert bits(probed["runs"][name]) == (stored["loss"], stored["example_loss"], stored["grads"]), name


@pytest.mark.slow
def test_the_comparison_catches_another_summation_order(probed):
    """The same all_to_all with a left-to-right sum instead of the tree: the loss is untouched,
    the gradients' bits are not, so equal digests above do mean the same adds in the same order."""
    runs = probed["runs"]
    seq, tree = runs["sequential:8x1"], runs["scatter:8x1"]
    assert seq["loss"] == tree["loss"]
    changed = [name for name, d in seq["grads"].items() if d != tree["grads"][name]]
    assert len(changed) >= len(seq["grads"]) // 2, changed


@pytest.mark.slow
def test_the_gradients_are_made_of_the_fixed_order_backward(probed):
    """Another summation order inside the same VJPs (tests/trainer/invariant_probe.interleaved_vjps), as
    correct, changes the gradient bits and not the loss: what the step's gradients hold is what those
    VJPs compute. Same layout, batch and key as scatter:1x1."""
    runs = probed["runs"]
    fixed, other = runs["scatter:1x1"], runs["interleaved:1x1"]
    assert other["loss"] == fixed["loss"] and other["example_loss"] == fixed["example_loss"]
    changed = [name for name, d in other["grads"].items() if d != fixed["grads"][name]]
    assert changed, "the gradients do not depend on the fixed-order VJPs: the step does not use them"
    assert probed["close_to_scatter"] == {"interleaved:1x1": True}  # within rtol 1e-4, atol 1e-7 of scatter's


@pytest.mark.slow
def test_scattered_sum_gives_the_bits_of_gathered_sum_on_3_devices(probed):
    """The reduce-scatter after the scan (device counts that are not powers of two), on random
    partial sums of a leaf it shards and one it cannot; a left-to-right sum differs."""
    assert probed["units"]["scattered_vs_gathered:3"] == {"equal": True, "left_fold_differs": True}


@pytest.mark.slow
def test_reduce_scatter_holds_less_per_device_at_8_devices(probed):
    """XLA's memory analysis of the compiled 8-device program against the previous reduction
    (gather:8x1: consecutive microbatches, every device's partial sums all-gathered). That put all
    8 devices' partial sums of a leaf on every device; the all_to_all holds 8 shards of 1/8 (one
    leaf's worth). Temporaries plus outputs (the whole gradient): at least 3 of the largest leaf less (about 6 while the scheduler
    runs leaves one by one, as XLA:CPU's does); and under 3 gradients in all (one microbatch's
    backward, about 1.5 G on XLA:CPU, the shards, the Counter's slots)."""
    runs, grad = probed["runs"], probed["grad_bytes"]
    before, after = runs["gather:8x1"]["memory"], runs["scatter:8x1"]["memory"]
    assert after["argument"] == before["argument"], (before, after)
    held = {name: m["temp"] + m["output"] for name, m in (("before", before), ("after", after))}
    assert held["before"] - held["after"] >= 3 * probed["largest_leaf_bytes"], held
    assert held["after"] < 3 * grad, (held, grad)


@pytest.mark.slow
def test_the_scan_holds_log2_partial_sums_not_every_microbatch_gradient(probed):
    """On one device the previous implementation stacked the scan's 8 microbatch gradients (8 G,
    measured 9.7 G of temporaries); the Counter holds log2(8) = 3 partial sums and the finished
    subtree (4 G). Under 6.5 G is asserted: one microbatch's backward (~1.5 G) and the 4."""
    runs, grad = probed["runs"], probed["grad_bytes"]
    assert runs["scatter:1x1"]["memory"]["temp"] < 6.5 * grad, (runs["scatter:1x1"]["memory"], grad)


@pytest.mark.slow
def test_the_gradient_state_shrinks_as_1_over_devices_and_the_previous_reduction_s_does_not(probed):
    """What a device keeps of the gradient across microbatches (the scan's carry) and the reduced
    gradient, read from each traced program (trainer/gradient_memory.py; 8 microbatches, G the
    gradient's bytes). The reduce-scatter: devices x state never grows from 1 to 2, 4, 8 devices
    (the Counter's bit_length(8 / n) shards of G / n, then this device's G / n; whole on 1
    device: 3 slots + 1 partial + the mean = 5 G), and on 8 devices it is 2 shards of G / 8 up to
    the leaves 8 does not divide. The previous reduction (consecutive microbatches, every
    device's partial sums all-gathered, the mean whole on every device) keeps at least G on every
    count, so its devices x state grows with the count: the measure tells them apart."""
    runs, grad = probed["runs"], probed["grad_bytes"]
    state = {n: runs[f"scatter:{n}x1"]["gradient_state"] for n in (1, 2, 4, 8)}
    assert state[1]["microbatch_steps"] == 8 and state[8]["microbatch_steps"] == 1
    assert state[1]["total"] == 5 * grad, state[1]
    products = [n * state[n]["total"] for n in (1, 2, 4, 8)]
    assert products == sorted(products, reverse=True) and products[-1] < products[0] / 2, products
    assert 2 * grad / 8 <= state[8]["total"] <= 1.1 * 2 * grad / 8, (state[8], grad)
    assert runs["scatter:2x2"]["gradient_state"] == state[4]  # the all_to_all over both axes: the same shards
    before = {n: runs[f"gather:{n}x1"]["gradient_state"]["total"] for n in (2, 8)}
    assert min(before.values()) >= grad and 8 * before[8] > 2 * before[2], (before, grad)


def test_split_axis_is_axis_0_where_the_devices_divide_it():
    assert [n for n in range(1, 17) if invariant.strided(n)] == [2, 4, 8, 16]
    assert invariant.split_axis((64, 320), 8) == 0
    assert invariant.split_axis((320, 64), 8) == 0
    assert invariant.split_axis((6, 12), 4) is None  # gathered whole, as before
    # axis 0 or none on every count, so that the norm's order is the same on every count
    assert invariant.split_axis((12, 8), 8) is None
    assert invariant.split_axis((), 2) is None
    assert invariant.split_axis((7,), 1) == 0

