"""Tail objects: the unsealed end of a segment on object storage, which has no append.

A remote writer keeps the segment it is filling on a local staging disk (the local format,
unchanged) and uploads the bytes appended since its last upload as one small immutable object
every N records or T seconds (traces/storage/mirror.py):

    trace/NNNNNNNNNNNN.seg.tail-KKKKKK   TAIL_HEAD (magic, K, byte offset in the segment, length,
                                          crc32 of the payload, crc32 of the head) + payload

A payload is a run of whole frames (the segment's header first), each frame with its own
checksum as on disk. Sealing uploads the segment whole and then deletes its tail objects. A
reader sees the tail objects of a segment that has no object of its own as that segment: the
View lists them and joins their payloads (`join`), so every reader reads them as it reads an
unsealed local segment. A tail object that is damaged, or a gap in their numbers, ends the
joined segment there and is named as damage (opening.py reports it as the tail's).
"""

from __future__ import annotations

import re
import struct

from traces.checksum import crc32

TAIL_MAGIC = b"RTAIL\x00\x01\x00"
_HEAD = struct.Struct("<8sIQII")  # magic, number, offset, payload length, payload crc32
TAIL_HEAD = _HEAD.size + 4  # + the head's own crc32
_NAME = re.compile(r"^(.+\.seg)\.tail-(\d{6})$")


def tail_name(segment: str, number: int) -> str:
    return f"{segment}.tail-{number:06d}"


def parse_name(name: str) -> tuple[str, int] | None:
    """(the segment's name, the tail's number), or None for any other object."""
    m = _NAME.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def encode(number: int, offset: int, payload: bytes) -> bytes:
    head = _HEAD.pack(TAIL_MAGIC, number, offset, len(payload), crc32(payload))
    return head + struct.pack("<I", crc32(head)) + payload


def decode(data: bytes, number: int, offset: int) -> tuple[bytes | None, str | None]:
    """(the payload, None) when the object is tail `number` starting at `offset`, whole and
    unchanged; else (None, why not)."""
    if len(data) < TAIL_HEAD:
        return None, f"it is {len(data)} bytes, shorter than its {TAIL_HEAD}-byte head"
    magic, n, at, size, crc = _HEAD.unpack_from(data)
    if magic != TAIL_MAGIC or struct.unpack_from("<I", data, _HEAD.size)[0] != crc32(data[: _HEAD.size]):
        return None, "its head is damaged (bad magic or checksum)"
    if (n, at) != (number, offset):
        return None, f"it holds tail {n} from byte {at}, expected tail {number} from byte {offset}"
    payload = data[TAIL_HEAD:]
    if len(payload) != size or crc32(payload) != crc:
        return None, "its bytes do not match its checksum"
    return payload, None


def start_of(data: bytes | None) -> int | None:
    """Where a tail object says its bytes go in the segment (None: not a readable tail object)."""
    if data is None or len(data) < TAIL_HEAD or data[:8] != TAIL_MAGIC:
        return None
    if struct.unpack_from("<I", data, _HEAD.size)[0] != crc32(data[: _HEAD.size]):
        return None
    return _HEAD.unpack_from(data)[2]


def join(objects: list[tuple[str, bytes | None]], start: int = 0) -> tuple[bytes, str | None, int]:
    """The segment's bytes from byte `start` (0, or where the segment's own object ends) from its
    tail objects [(name, data)] in number order, and the first problem met (a damaged or missing
    tail: the segment ends before it), with the byte where it stops."""
    out = bytearray()
    for k, (name, data) in enumerate(objects):
        parsed = parse_name(name)
        if parsed is None or parsed[1] != k:
            return bytes(out), f"{name}: tail {k} is missing (a gap in the tail objects)", start + len(out)
        payload, why = (None, "it could not be read") if data is None else decode(data, k, start + len(out))
        if payload is None:
            return bytes(out), f"{name}: {why}", start + len(out)
        out += payload
    return bytes(out), None, start + len(out)
