"""The distance sketch in torch and in JAX against the numpy definition (traces/sketch.py), and
in a recorded torch run."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import replay.torch  # noqa: E402
import replay.torch.fingerprint as tfp  # noqa: E402
from replay.torch.sketch import sketch as torch_sketch  # noqa: E402
from traces import Run  # noqa: E402
from traces.sketch import relative_distance, sketch, signs_negative  # noqa: E402

SHAPES = [(), (5,), (3, 7), (64, 64), (1000,), (4, 33, 17)]


def _bucket_abs(x: np.ndarray, width: int) -> np.ndarray:
    """sum of |v| over each bucket: the scale of the tolerance (traces/sketch.py)."""
    from traces.sketch import bucket_and_sign

    v = np.abs(np.asarray(x, np.float32).reshape(-1).astype(np.float64))
    b, _ = bucket_and_sign(np.arange(v.size, dtype=np.uint32), width)
    return np.bincount(b, weights=v, minlength=width)


def _within_tolerance(got: np.ndarray, want: np.ndarray, x: np.ndarray, width: int) -> bool:
    return bool(np.all(np.abs(got.astype(np.float64) - want) <= 2.0 ** -22 * _bucket_abs(x, width)))


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_sketch_is_the_numpy_definition(shape, exact, monkeypatch):
    monkeypatch.setattr(tfp, "EXACT", exact)
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    got, norm = torch_sketch(torch.from_numpy(x.copy()), 32)
    want, want_norm = sketch(x, 32)
    # Both sum in float64 and round once: equal here (the tolerance would allow 2**-22 of a bucket).
    np.testing.assert_array_equal(got, want)
    assert norm == pytest.approx(want_norm, rel=1e-7)


@pytest.mark.parametrize("exact", [False, True])
def test_kept_and_fresh_signs_give_the_same_sketch(exact, monkeypatch):
    """A small chunk's signs and row offsets are hashed once and kept (sketch._first_rows, what
    the test above runs): hashed afresh for every call instead, the sketch is the same numpy one."""
    import replay.torch.sketch as tsk

    monkeypatch.setattr(tfp, "EXACT", exact)
    monkeypatch.setattr(tsk, "_CACHED_ELEMENTS", 0)  # nothing kept: every chunk hashed as it comes
    for shape in SHAPES:
        x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(torch_sketch(torch.from_numpy(x.copy()), 32)[0], sketch(x, 32)[0])


def test_jax_sketch_is_the_numpy_definition_within_float32_rounding():
    jax = pytest.importorskip("jax")
    from replay.record.fingerprint import sketch_and_norm

    for shape in SHAPES + [(300, 1024)]:
        x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
        got, norm = jax.jit(lambda x: sketch_and_norm(x, 64))(x)
        want, want_norm = sketch(x, 64)
        # JAX sums in float32 (no x64): not the same order, so within the stated tolerance, not bits.
        assert _within_tolerance(np.asarray(got), want.astype(np.float64), x, 64), shape
        assert float(norm) == pytest.approx(float(want_norm), rel=1e-6)
    # The tolerance is tight enough to see one element of 300k changed by 0.01.
    x = np.random.default_rng(8).standard_normal((300, 1024)).astype(np.float32)
    y = x.copy()
    y[123, 45] += 0.01
    got, _ = jax.jit(lambda x: sketch_and_norm(x, 64))(y)
    assert not _within_tolerance(np.asarray(got), sketch(x, 64)[0].astype(np.float64), x, 64)


def test_torch_bf16_and_int_tensors_sketch_by_their_float32_values():
    x = torch.randn(40, 9).to(torch.bfloat16)
    np.testing.assert_array_equal(torch_sketch(x, 16)[0], sketch(x.to(torch.float32).numpy(), 16)[0])
    i = torch.arange(-50, 50, dtype=torch.int64)
    np.testing.assert_array_equal(torch_sketch(i, 16)[0], sketch(i.numpy(), 16)[0])


def test_the_sign_is_per_element():
    neg = signs_negative(np.arange(4096, dtype=np.uint32))
    assert 0.45 < neg.mean() < 0.55


def test_a_recorded_torch_run_holds_each_tensors_sketch(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = replay.torch.init(tmp_path / "run", model=model, optimizer=opt, sketch_width=16)
    after = []
    for k in range(2):
        x = torch.randn(4, 8)
        with run.step(torch.arange(4 * 3).reshape(4, 3) + k) as rec:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            rec.metrics(loss=loss)
        opt.zero_grad()
        after.append({n: p.detach().numpy().copy() for n, p in model.named_parameters()})
    run.finish()
    r = Run.open(tmp_path / "run")
    assert r.manifest["format_version"] == 3 and r.schema.sketch_width == 16  # sketches since 2
    names = r.schema.tensor_names
    for k in range(2):
        rec = r.trace.read(k)
        assert rec.sketches.shape == (len(names), 16)
        for n, value in after[k].items():
            i = names.index(f"param/{n}")
            np.testing.assert_array_equal(rec.sketches[i], sketch(value, 16)[0])
            assert rec.norms[i] == pytest.approx(np.linalg.norm(value.astype(np.float64)), rel=1e-6)
    # The two steps' parameters differ, and their sketches say by how much.
    i = names.index("param/0.weight")
    est = relative_distance(r.trace.read(0).sketches[i], r.trace.read(0).norms[i],
                            r.trace.read(1).sketches[i], r.trace.read(1).norms[i])
    a, b = after[0]["0.weight"], after[1]["0.weight"]
    exact = np.linalg.norm(a - b) / max(np.linalg.norm(a), np.linalg.norm(b))
    assert exact / 2 <= est <= 2 * exact


def test_sketch_width_zero_records_a_version_1_layout(tmp_path):
    model = torch.nn.Linear(3, 2)
    run = replay.torch.init(tmp_path / "run", model=model, sketch_width=0)
    with run.step(torch.zeros(2, 3, dtype=torch.int64)) as rec:
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        rec.metrics(loss=loss)
    run.finish()
    r = Run.open(tmp_path / "run")
    assert r.schema.sketch_width == 0 and r.trace.read(0).sketches is None
