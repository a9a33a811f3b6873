"""The frame of one example in an example store's rows.bin (replay/record/examples_store.py writes
and reads them; replay/record/examples_index.py checks that an index ends where rows.bin does).

    offset size
     0      4   magic b"RXMP"
     4      8   u64 the example's hash
    12      4   u32 compressed size (clen)
    16      4   u32 raw size
    20      4   u32 crc32 of bytes 0..19 and the compressed bytes
    24   clen   the example's row, zstd-compressed

(traces/FORMAT.md "The example store" specifies the file.)
"""

from __future__ import annotations

import struct
from pathlib import Path

MAGIC = b"RXMP"
HEAD = struct.Struct("<4sQII")  # magic, hash, clen, raw size; then u32 crc32
SIZE = HEAD.size + 4  # a frame's bytes before its compressed row


def frame_check(rows: Path, last: int, covered: int, crc: int) -> bool:
    """Whether rows.bin holds a frame at `last` that ends at `covered` and carries crc32 field `crc`."""
    if covered == 0:
        return last == 0
    if covered > rows.stat().st_size or last + SIZE > covered:
        return False
    with open(rows, "rb") as f:
        f.seek(last)
        head = f.read(SIZE)
    if len(head) < SIZE:
        return False
    magic, _h, clen, _rlen = HEAD.unpack_from(head)
    ends_there = magic == MAGIC and last + SIZE + clen == covered
    return ends_there and struct.unpack_from("<I", head, HEAD.size)[0] == crc
