"""crc32: the checksum of every frame, block, column and segment of a trace (FORMAT.md).

The CRC is zlib's (CRC-32/ISO-HDLC, `zlib.crc32(data, value)`); this is the one place that
picks its implementation. ISA-L's (the `isal` package) computes the same values with the CPU's
carry-less multiply: on this machine's AMD EPYC, 10.9 against 3.1 GB/s over 64 MB, 5.5 against
1.35 GB/s in the 2,304-byte blocks of a segment index's table, and faster for the shortest
inputs too (a 60-byte filter block 64 against 193 ns). `replay audit` checks every table block it
reads, ~13 GB of them at 1.4M steps of 1,024 examples: with zlib's that was ~15% of its CPU.
Where `isal` does not import, zlib's computes the same values, slower.
"""

from __future__ import annotations

import zlib

try:
    from isal.isal_zlib import crc32 as _fast
except ImportError:  # no wheel for this platform: the same values from zlib
    _fast = None

crc32 = _fast or zlib.crc32  # crc32(data, value=0) -> int, as zlib.crc32
IMPLEMENTATION = "isal" if _fast is not None else "zlib"

__all__ = ["crc32", "IMPLEMENTATION"]
