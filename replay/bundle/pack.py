"""Packing a bug-report bundle (`replay pack`): choosing the steps and the checkpoint, collecting
the checkpoint, the trace and the examples the steps feed, and writing the bundle file
(replay/bundle/format.py specifies it)."""

from __future__ import annotations

import hashlib
import os
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zstandard

import traces
from replay.bundle.finding import _bisect_finding, _json_safe, _spike_finding
from replay.bundle.format import (EXAMPLES, FORMAT_VERSION, HEADER_SIZE, REPORT, SUFFIX, ZSTD_LEVEL, PackError,
                                  _encode_header, open_run)
from replay.engine.damage import damage_error
from replay.engine.protocol import local_run
from replay.bundle.report import render_report
from traces import Run
from traces.run import COMPLETE, MANIFEST, TRACE_DIR, write_json_atomic, write_manifest
from traces.storage import is_url, shown
from replay import rundata
from replay.engine.code import OWN_FACTORIES
from replay.record.exported import pack_refusal, stage_for_bundle
from replay.record.manifest import FACTORY as LOOP_FACTORY
import shutil
from replay.record.checkpoints import run_checkpoint_dir
from traces.storage.ondemand import fetch_checkpoint


@dataclass
class Part:
    name: str  # "checkpoint", "trace", "batch data", "manifest and report"
    detail: str
    raw_bytes: int
    packed_bytes: int  # compressed bytes in the bundle (zstd flushed at each part's end)


@dataclass
class PackResult:
    path: Path
    size: int
    sha256: str
    lite: bool
    steps: tuple[int, int]
    checkpoint: int | None
    trace: tuple[int, int]
    examples: int
    parts: list[Part] = field(default_factory=list)
    finding: dict | None = None
    report: str = ""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "path": str(self.path), "size": self.size, "sha256": self.sha256, "format_version": FORMAT_VERSION,
            "lite": self.lite, "steps": list(self.steps), "checkpoint": self.checkpoint, "trace": list(self.trace),
            "examples": self.examples, "finding": self.finding, "notes": self.notes,
            "parts": [{"name": p.name, "detail": p.detail, "raw_bytes": p.raw_bytes, "packed_bytes": p.packed_bytes}
                      for p in self.parts],
        }


def pack(run_path: str | os.PathLike, out: str | os.PathLike, steps: tuple[int, int] | None = None, *,
         lite: bool = False, force: bool = False, data: str | None = None, from_bisect: str | os.PathLike | None = None,
         spike: int | None = None, on_status=None) -> PackResult:
    """Writes the bundle of steps A..B of the run (or bundle) at `run_path` to `out`."""
    status = on_status or (lambda msg: None)
    out = Path(out)
    if out.is_dir():
        raise PackError(f"-o {out}: is a folder; name the bundle file to write (e.g. {out / ('bug' + SUFFIX)})")
    if out.exists() and not force:
        raise PackError(f"{out}: already exists; pass --force to overwrite it, or choose another -o")
    if not out.parent.is_dir():
        raise PackError(f"-o {out}: the folder {out.parent} does not exist")
    run = open_run(run_path)
    damaged = damage_error(run, str(run_path), "a bundle of it would not replay: restore the run's files from a copy")
    if damaged:
        raise damaged
    trace = run.trace
    if len(trace) == 0:
        raise PackError(f"{run_path}: the trace holds no steps; nothing to pack")
    finding = None
    if from_bisect is not None:
        finding = _bisect_finding(run, run_path, from_bisect)
        if not finding["identical"] or steps is not None:
            status(f"bisect {run_path} vs {from_bisect}: {finding['headline']}")
    if spike is not None:
        finding = _spike_finding(run, run_path, spike, data, status)
    if steps is None:
        steps = _steps_around(run, finding, run_path)
    first, last = steps
    if first < trace.start or last >= trace.end:
        raise PackError(f"--steps {first}:{last} is outside the recorded steps {trace.start}..{trace.end - 1} of {run_path}")
    if finding and finding.get("step") is not None and not first <= finding["step"] <= last:
        status(f"note: the finding's step {finding['step']} is outside --steps {first}:{last}")
    checkpoint = None if lite else _checkpoint_for(run, run_path, first)
    trace_first = first if lite else checkpoint
    if trace_first < trace.start:
        raise PackError(f"{run_path}: the trace starts at step {trace.start}, after checkpoint {checkpoint}; "
                        "the warm-up steps from the checkpoint cannot be verified")
    with tempfile.TemporaryDirectory(prefix="replay-pack-") as tmp:
        stage = Path(tmp)
        writer = traces.TraceWriter(stage / TRACE_DIR, run.schema)
        for s in range(trace_first, last + 1):  # streamed: a long --lite range never sits in memory
            writer.append(trace.read(s))
        writer.close()
        staged = traces.TraceReader(stage / TRACE_DIR, run.schema)  # re-read: what the bundle holds
        if (staged.start, staged.end, staged.damage) != (trace_first, last + 1, []):
            raise PackError(f"{out}: the re-written trace does not read back as steps {trace_first}..{last}")
        examples_meta, api_files, api_manifest = None, [], {}
        api_run = run.manifest.get("replayable") == LOOP_FACTORY  # a replay.Loop's: replays from its exported program (replay/record/exported.py)
        # A run on object storage: its checkpoint, program and examples come from its local copy,
        # made once per process (traces/storage/ondemand.local_copy: checkpoint C fetched below); the trace
        # above and `packed_from` are the URL's.
        source = run if lite else local_run(run)
        if not lite:
            status(f"collecting the batches of steps {checkpoint}..{last}")
            if api_run:
                examples_meta, api_files, api_manifest = stage_for_bundle(source, stage, checkpoint, last, staged)
            else:
                examples_meta = _write_examples(source, run_path, stage / EXAMPLES, checkpoint, last, staged, data)
        info = {
            "format_version": FORMAT_VERSION, "lite": lite, "steps": [first, last], "checkpoint": checkpoint,
            "trace": [trace_first, last], "examples": None if lite else api_files[-1].relative_to(stage).as_posix()
            if api_files else EXAMPLES,
            "example_count": examples_meta["examples"] if examples_meta else 0,
            "packed_from": str(run.path) if is_url(run.path) else str(Path(getattr(run, "bundle", None) or run.path).absolute()),
            "source_status": run.status,
            "source_steps": [trace.start, trace.end - 1], "finding": _json_safe(finding),
        }
        # The bundle's trace starts at `trace_first`: recorded, so a bundle missing its leading
        # records reads as damaged. The checksum is the bundle's own, computed by write_manifest.
        manifest = {**_without_code(run.manifest, info),
                    "checkpoints": [] if lite else [checkpoint], "trace_first_step": trace_first, "bundle": info,
                    **api_manifest}
        write_manifest(stage / MANIFEST, manifest)
        write_json_atomic(stage / COMPLETE, {"end": last + 1})
        report = render_report(manifest, run.schema, staged, out.name, finding=finding)
        (stage / REPORT).write_text(report)
        groups = [
            ("manifest and report", f"run.json, {REPORT}", [stage / MANIFEST, stage / COMPLETE, stage / REPORT], stage),
            ("trace", f"steps {trace_first}..{last}, {last - trace_first + 1} records", sorted((stage / TRACE_DIR).iterdir()),
             stage),
        ]
        if not lite and api_run:
            groups.append(("batch data", examples_meta["detail"], api_files, stage))
        elif not lite:
            groups.append(("batch data", f"{examples_meta['examples']} examples of {examples_meta['seq_len'] + 1} tokens",
                           [stage / EXAMPLES], stage))
        if not lite:
            ckpt_dir = source.checkpoint_dir / str(checkpoint)
            fetch_checkpoint((run_checkpoint_dir(source) if api_run else ckpt_dir.parent) / str(checkpoint))  # remote: now
            if api_run:  # the folder its manifest names (maybe the user's CheckpointManager's), bundled as checkpoints/C
                ckpt_dir = run_checkpoint_dir(source) / str(checkpoint)
                if ckpt_dir.is_dir() and ckpt_dir.resolve() != (source.path / "checkpoints" / str(checkpoint)).resolve():
                    shutil.copytree(ckpt_dir, stage / "checkpoints" / str(checkpoint))
                    ckpt_dir = stage / "checkpoints" / str(checkpoint)
            if not ckpt_dir.is_dir():
                raise PackError(f"{run_path}: checkpoint {checkpoint} is not the folder {ckpt_dir}; "
                                "pack with --lite, or copy the run with its checkpoints")
            groups.append(("checkpoint", f"step {checkpoint}", _files_under(ckpt_dir), ckpt_dir.parent.parent))
        status(f"writing {out}")
        result = _write_bundle(out, groups, lite)
    result.steps, result.checkpoint, result.trace = (first, last), checkpoint, (trace_first, last)
    result.examples = info["example_count"]
    result.finding, result.report = finding, report
    return result


def _without_code(manifest: dict, info: dict) -> dict:
    """The run's manifest as a bundle carries it: naming no code but replay's own factory (a bundle
    never chooses code, replay/bundle/trust.py): no folder of code, and a loop's own
    factory (a legacy "replayable", only ever in a --lite bundle) kept in `info` as a fact, unused."""
    out = {k: v for k, v in manifest.items() if k not in ("replayable_path", "entrypoint_path")}
    if out.get("replayable") not in (None, *OWN_FACTORIES):
        info["source_replayable"] = out.pop("replayable")
        out.pop("entrypoint", None)
    return out


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_dir())


def _checkpoint_for(run: Run, run_path, first: int) -> int:
    if run.manifest.get("replayable") == LOOP_FACTORY:  # a replay.Loop recorded through replay.init: its exported program and examples

        why = pack_refusal(run.manifest)
        if why:
            raise PackError(f"{run_path}: a full bundle cannot be packed: {why}; pack it with --lite (trace and report)")
    from replay.engine.engine import checkpoint_steps, latest_checkpoint

    have = checkpoint_steps(run)
    start = latest_checkpoint(have, first)
    if start is None:
        listed = ", ".join(map(str, have)) or "none"
        raise PackError(f"{shown(run_path)} has no checkpoint at or before step {first} (checkpoints: {listed}); pack a range "
                        "that starts at or after a checkpoint, or use --lite (no replay)")
    return start


def _open_data(run: Run, run_path, data: str | None):
    """The run's data-only view (replay/rundata.py: no compile): the token source it was trained on,
    or the rows a bundle carries, fingerprint checked."""
    try:
        view = rundata.run_data(run, data=data)
        for name, what in (("fingerprint", "fingerprint() of its source"), ("batch_ids", "batch_ids(step) -> int64 [B]"),
                           ("write_examples", "write_examples(path, ids), the rows a bundle carries"),
                           ("carried", "carried(path) -> the data served from those rows"),
                           ("fed_hashes", "fed_hashes(step) -> uint64 [B], the hashes of the batch a step was fed")):
            rundata.capability(view, name, what)
    except rundata.NoDataEntry as e:
        raise PackError(f"{run_path}: a full bundle cannot be packed: {e}; pack it with --lite (trace and report)") from None
    spec = view.source_name  # reads the run's config first: an unreadable one is its own error, not the data's
    try:
        found = view.fingerprint()
    except ValueError as e:  # trainer.data.DataError: the source cannot be read
        raise PackError(f"the data source of {run_path} cannot be read ({e}); pass --data PATH to point at it, "
                        "or pack with --lite") from None
    recorded = run.manifest.get("data", {}).get("fingerprint")
    if recorded and found != recorded:
        raise PackError(f"data source {spec} has changed since {run_path} was recorded (fingerprint "
                        f"{found[:12]} != {recorded[:12]}); pass --data PATH to the original data")
    return view


def _write_examples(run: Run, run_path, path: Path, start: int, last: int, staged, data: str | None) -> dict:
    """Writes the rows of every example that steps start..last feed, and checks that they rebuild
    every recorded batch through the run's fault plan, as the replay will feed them. Cost: the rows
    of those steps' examples (B a step), read, written and hashed once."""
    view = _open_data(run, run_path, data)
    ids = np.concatenate([view.batch_ids(s) for s in range(start, last + 1)])  # the file holds each row once
    meta = view.write_examples(path, ids)
    carried = view.carried(path)
    for rec in staged.records(start, last + 1):
        rebuilt = np.asarray(carried.fed_hashes(rec.step), np.uint64)
        if not np.array_equal(rebuilt, rec.example_hashes):
            bad = int(np.flatnonzero(rebuilt != rec.example_hashes)[0])
            raise PackError(f"{run_path}: the data source does not rebuild the batch recorded at step {rec.step} "
                            f"(example {bad} differs); the run's data or its trace does not match: check the run "
                            "with `replay run` before packing it")
    return meta


class _Sink:
    """The bundle file behind the compressor: hashes and counts what is written."""

    def __init__(self, f):
        self.f, self.size, self.sha = f, 0, hashlib.sha256()

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


class _Counter:
    """The tar stream in front of the compressor: tarfile needs tell()."""

    def __init__(self, w):
        self.w, self.pos = w, 0

    def write(self, b) -> int:
        self.w.write(b)
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos


def _tarinfo(name: str, size: int, is_dir: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0, 0, 0, "", ""
    if is_dir:
        info.type, info.mode, info.size = tarfile.DIRTYPE, 0o755, 0
    else:
        info.mode = 0o644
    return info


def _write_bundle(out: Path, groups, lite: bool) -> PackResult:
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    parts: list[Part] = []
    try:
        with open(tmp, "wb") as f:
            f.write(b"\0" * HEADER_SIZE)
            sink = _Sink(f)
            cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
            with cctx.stream_writer(sink, closefd=False) as zw:
                counter = _Counter(zw)
                tar = tarfile.open(fileobj=counter, mode="w", format=tarfile.PAX_FORMAT)
                for name, detail, files, root in groups:
                    before, raw = sink.size, 0
                    for p in files:
                        arc = p.relative_to(root).as_posix()
                        if p.is_dir():
                            tar.addfile(_tarinfo(arc, 0, True))
                            continue
                        size = p.stat().st_size
                        with open(p, "rb") as src:
                            tar.addfile(_tarinfo(arc, size), src)
                        raw += size
                    zw.flush(zstandard.FLUSH_BLOCK)
                    parts.append(Part(name, detail, raw, sink.size - before))
                before = sink.size
                tar.close()
            parts[0].packed_bytes += sink.size - before + HEADER_SIZE  # the header, the tar and zstd trailers
            f.seek(0)
            f.write(_encode_header(sink.size, sink.sha.digest(), lite))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    size = out.stat().st_size
    return PackResult(out, size, sink.sha.hexdigest(), lite, (0, 0), None, (0, 0), 0,
                      sorted(parts, key=lambda p: -p.packed_bytes))


def _steps_around(run: Run, finding: dict | None, run_path) -> tuple[int, int]:
    trace = run.trace
    if not finding or finding.get("step") is None:
        if finding and finding.get("kind") == "bisect":
            raise PackError(f"{run_path} and {finding['run_b']} do not differ in the steps both hold; "
                            "pass --steps A:B to pack a range anyway")
        raise PackError("--steps A:B is required (the steps to pack, B inclusive)")
    s = finding["step"]
    before = finding.get("window", 5)  # a spike's baseline window, so `replay spike` works on the bundle too
    return max(trace.start, s - before), min(trace.end - 1, s + 2)
