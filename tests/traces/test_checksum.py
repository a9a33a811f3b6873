"""traces.checksum.crc32 is zlib's CRC-32 (every checksum in a trace is), whichever implementation computes it."""

from __future__ import annotations

import importlib
import sys
import zlib

import numpy as np
import pytest

import traces.checksum as checksum


def test_the_installed_fast_crc_is_the_one_used():
    # the dev install has isal (pyproject's dependencies): the fast path is the one the suite runs
    assert checksum.IMPLEMENTATION == "isal" and checksum.crc32 is not zlib.crc32


@pytest.mark.parametrize("length", [0, 1, 15, 16, 60, 64, 255, 1300, 2304, 4097, 65537])
def test_crc32_is_zlibs_on_every_length_start_value_and_buffer_kind(length):
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8)
    raw = data.tobytes()
    for start in (0, 1, 0xFFFFFFFF, zlib.crc32(b"head")):
        want = zlib.crc32(raw, start)
        assert checksum.crc32(raw, start) == want
        assert checksum.crc32(memoryview(raw), start) == want
        assert checksum.crc32(data, start) == want  # a numpy row, as the filter's blocks are checked
    assert checksum.crc32(raw) == zlib.crc32(raw)
    if length:  # and it sees one flipped bit
        flipped = bytearray(raw)
        flipped[length // 2] ^= 0x10
        assert checksum.crc32(bytes(flipped)) != checksum.crc32(raw)


def test_without_isal_the_values_come_from_zlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)  # as if no wheel installed
    try:
        fallback = importlib.reload(checksum)
        assert fallback.IMPLEMENTATION == "zlib" and fallback.crc32 is zlib.crc32
    finally:
        monkeypatch.undo()
        importlib.reload(checksum)
    assert checksum.IMPLEMENTATION == "isal"
