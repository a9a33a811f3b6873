"""Bug-report bundles: one file that replays steps A..B of a run anywhere (`replay pack`).

The public module: the rest of replay imports bundles from here. The code lives by concept in

    replay/bundle/format.py   the bundle file format (specified in its docstring): header,
                              checksums, read/verify/unpack, and open_run (a run or a bundle)
    replay/bundle/trust.py    what a bundle may hold beyond its checksums: its layout, no code,
                              a manifest that names no code, and unpack's mark on its folder
    replay/bundle/pack.py     packing: the steps, the checkpoint, trace and examples, the file
    replay/bundle/finding.py  the finding of --from-bisect/--spike
    replay/bundle/report.py   the REPORT.md writer
"""

from __future__ import annotations

from replay.bundle.format import (EXAMPLES, FLAG_LITE, FORMAT_VERSION, HEADER_SIZE, MAGIC, PREFIX_SIZE, REPORT, SUFFIX,
                                  ZSTD_LEVEL, BundleCorruptError, Header, NewerBundleError, NotABundleError, PackError,
                                  default_steps, is_bundle, open_run, read_header, unpack, verify)
from replay.bundle.pack import PackResult, Part, pack
from replay.bundle.report import FINDING_ROWS, MAX_TABLE_ROWS, fmt_bytes, render_report, sample_steps

__all__ = [
    "EXAMPLES", "FINDING_ROWS", "FLAG_LITE", "FORMAT_VERSION", "HEADER_SIZE", "MAGIC", "MAX_TABLE_ROWS", "PREFIX_SIZE",
    "REPORT", "SUFFIX", "ZSTD_LEVEL",
    "BundleCorruptError", "NewerBundleError", "NotABundleError", "PackError",
    "Header", "PackResult", "Part",
    "default_steps", "fmt_bytes", "is_bundle", "open_run", "pack", "read_header", "render_report", "sample_steps", "unpack",
    "verify",
]
