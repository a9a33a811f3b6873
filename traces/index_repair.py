"""Writing the missing or damaged index files of a trace's sealed segments after the fact.

A writer writes each segment's index when it seals it (traces/writer.py); a run recorded before
replay wrote them, or one whose index was damaged, gets them here, without a writer.
"""

from __future__ import annotations

import os
from pathlib import Path

from traces.index import IndexUnusable, index_path
from traces.schema import Schema
from traces.trace import TraceReader


def write_indexes(trace_dir: str | os.PathLike, schema: Schema) -> list[Path]:
    """Writes the index file of every sealed segment that lacks a usable one (a run recorded
    before replay wrote them, or one whose index was damaged); returns the files written.
    Reads each such segment once, in chunks; checks nothing else. A compacted segment's index
    held its example hashes' only copy (traces/compaction.py): one missing or damaged cannot be
    written again, and TraceCorruptError says so."""
    reader = TraceReader(trace_dir, schema)
    written = []
    for i, seg in enumerate(reader.segments):
        if not seg.sealed:
            continue
        index = reader._file_index(i)
        if index is not None:
            try:
                index.columns()
                continue  # usable
            except IndexUnusable:
                pass
        builder, end = reader.index_builder(i)
        builder.write(index_path(seg.path), end, seg.content_crc, seg.size)
        written.append(index_path(seg.path))
    return written
