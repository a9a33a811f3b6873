"""replay.torch's tensor fingerprint equals the numpy reference (traces/fingerprint.py) bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from replay.torch import fingerprint as tfp  # noqa: E402
from traces.fingerprint import fingerprint as reference  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (4, 0, 2)]


def _random(dtype: torch.dtype, shape: tuple, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 1000
    if dtype == torch.bool:
        return x > 0
    if dtype.is_complex:
        return torch.complex(x, -x / 3).to(dtype)
    return x.to(dtype)


def _numpy_fingerprint(t: torch.Tensor) -> int:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as uint16, named for the seed
        return reference(np.array(t.view(torch.int16).numpy().view(np.uint16)), dtype_name="bfloat16")
    return reference(np.array(t.numpy()))  # not ascontiguousarray: it makes a 0-d array 1-d


@pytest.fixture(params=["int32", "exact"])
def path(request, monkeypatch):
    """Both implementations: wrapping int32 (used where the device wraps) and exact int64."""
    monkeypatch.setattr(tfp, "EXACT", request.param == "exact")
    if request.param == "int32":
        assert tfp._int32_wraps(torch.device("cpu"))  # else the fast path would never run here
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_equals_the_numpy_reference(dtype, path):
    for i, shape in enumerate(SHAPES):
        t = _random(dtype, shape, seed=i)
        assert tfp.fingerprint(t) == _numpy_fingerprint(t), shape
        if t.dim() >= 2:  # a non-contiguous view (a transposed weight) is the tensor it shows
            v = t.transpose(0, 1)
            assert not v.is_contiguous() or v.numel() == 0
            assert tfp.fingerprint(v) == _numpy_fingerprint(v.contiguous()), shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_one_lane_at_a_time_equals_both_lanes_at_once(dtype, monkeypatch):
    """The int32 path takes a small chunk's two lanes in one pass, a big one's one lane at a time
    (fingerprint._STACKED_WORDS): with every chunk taken one lane at a time, the same bits."""
    monkeypatch.setattr(tfp, "EXACT", False)
    monkeypatch.setattr(tfp, "_STACKED_WORDS", 0)
    for i, shape in enumerate(SHAPES):
        t = _random(dtype, shape, seed=i)
        assert tfp.fingerprint(t) == _numpy_fingerprint(t), shape


def test_chunking_does_not_change_it(monkeypatch, path):
    t = _random(torch.float32, (5, 9), seed=3)
    whole = tfp.fingerprint(t), tfp.fingerprint(t.t())
    monkeypatch.setattr(tfp, "CHUNK_ELEMENTS", 7)  # chunks split rows and blocks of rows
    assert (tfp.fingerprint(t), tfp.fingerprint(t.t())) == whole
    assert whole == (_numpy_fingerprint(t), _numpy_fingerprint(t.t().contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_a_flipped_bit_changes_it(dtype, path):
    t = _random(dtype, (4, 6), seed=1)
    base = tfp.fingerprint(t)
    bits = t.element_size() * 8
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    for element, bit in [(0, 0), (7, bits - 1), (23, bits // 2)]:
        flipped = t.clone()
        words = flipped.view(view).reshape(-1)
        words[element] ^= torch.tensor(1, dtype=view) << bit
        assert tfp.fingerprint(flipped) != base
        assert tfp.fingerprint(flipped) == _numpy_fingerprint(flipped)


def test_moving_an_element_changes_it(path):
    t = _random(torch.float32, (8,), seed=2)
    assert tfp.fingerprint(t.flip(0)) != tfp.fingerprint(t)
    assert tfp.fingerprint(t.reshape(2, 4)) != tfp.fingerprint(t)  # the shape is in the seed


def test_the_stack_of_lanes_summary_equals_the_reference():
    lanes = torch.tensor([[1, 2**32 - 1], [0xDEADBEEF, 7], [0, 0]], dtype=torch.int64)
    l0, l1 = (int(v) for v in tfp.words_lanes(lanes, "uint32"))
    assert (l0 << 32) | l1 == reference(lanes.numpy().astype(np.uint32))


def test_sum_of_squares():
    t = _random(torch.float32, (3, 4))
    _, ss = tfp.lanes_and_sum_of_squares(t)
    assert float(ss) == pytest.approx(float((t.double() ** 2).sum()), rel=1e-6)  # accumulated in float32


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_refuses_what_numpy_cannot_check():
    with pytest.raises(TypeError, match="unsupported"):
        tfp.fingerprint(torch.zeros(4, dtype=torch.complex32))
