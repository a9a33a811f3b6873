"""`replay show RUN`: what a run holds, whether it finished, and its last metrics.

Read-only: it never writes to the run directory (a crashed run stays exactly as it was, so
`replay train --resume` can repair it later). `summarize` builds the report as plain data;
`show` prints it as tables or as one JSON object and sets the exit code:

  0  a complete (or still running) run whose trace reads cleanly
  2  bad input: no such run, not a run, newer format, or a crashed or damaged run
     (for a crashed or damaged run the summary is still printed, then one error line)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

import traces
from replay.cli import console
from traces.schema import check_tensors
from traces.storage import shown
from replay.bundle import open_run
from replay.engine.damage import bundle_terms, run_damage

# Config fields worth a line in the human summary, when the manifest's config has them.
CONFIG_KEYS = (
    "preset", "seed", "steps", "model.n_layers", "model.d_model", "model.dtype", "data.source",
    "data.global_batch_size", "mesh.mesh_invariant", "trace.level",
)
MAX_DETAIL_ROWS = 12  # environment/data entries shown before "... see --json"
MAX_LISTED_CHECKPOINTS = 12


def register(app: typer.Typer) -> None:
    app.command("show")(show)


def show(
    run: Annotated[Path, typer.Argument(metavar="RUN", help="The run directory (what `replay train --out` wrote).", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")] = False,
    verify: Annotated[
        bool, typer.Option("--verify", help="Check every record's checksum (reads the whole trace), not only the tail.")
    ] = False,
) -> None:
    """Show a run: manifest summary, step range, completeness, checkpoints and last metrics."""
    summary = summarize(run, verify=verify)
    if json_out:
        console.print_json(summary)
    else:
        render(summary)
    for note in summary["notes"]:
        console.status(note)
    for warning in summary["warnings"]:
        console.warn(warning)
    if summary["problem"]:
        console.fail(summary["problem"])


# ------------------------------------------------------------------------------ the data


def summarize(path: str | Path, verify: bool = False) -> dict[str, Any]:
    """Everything `show` reports, as JSON-ready data. Raises traces.TraceError on bad input."""
    run = open_run(path)  # a run folder, or a bundle (`replay pack`) unpacked to a temporary folder
    manifest = run.manifest
    schema = run.schema
    reader = run.trace
    damage = _found_damage(run, verify, run_damage(run, crash_tail=False))
    status = run.status

    last = None
    if len(reader):
        try:
            rec = reader.read(reader.end - 1)
            last = {"step": rec.step, "metrics": _metric_values(schema, rec.metrics)}
        except traces.TraceCorruptError as e:
            damage.append(traces.Damage(e.path or str(reader.dir), 0, e.step, str(e).split(": ", 1)[-1]))
    # A bundle's files are named inside the bundle (BUNDLE:trace/...), not in its temporary folder.
    damage = [traces.Damage(bundle_terms(run, d.path), d.offset, d.step, bundle_terms(run, d.reason)) for d in damage]
    tail = (bundle_terms(run, str(reader.tail[0])), reader.tail[1]) if reader.tail is not None else None

    loop_folder, loop_steps = _loop_checkpoints(manifest)
    summary: dict[str, Any] = {
        "path": shown(path),  # a URL as given (a Path argument turns gs:// into gs:/)
        "format_version": manifest["format_version"],
        "status": status,
        "steps": {
            "start": reader.start,
            "end": reader.end,  # exclusive
            "last": reader.end - 1 if len(reader) else None,
            "count": len(reader),
        },
        "schema": {
            "examples_per_step": schema.examples_per_step,
            "rng_words": schema.rng_words,
            "metric_dtype": schema.metric_dtype,
            "metrics": list(schema.metric_names),
            "tensors": len(schema.tensors),
            "example_metrics": list(schema.example_metrics),
        },
        # replay's own, and those the loop's own checkpoints give (a MaxText run's: run.json's loop_checkpoints,
        # written by its launcher as MaxText saves; show runs none of the run's code)
        "checkpoints": sorted(set(_checkpoint_steps(manifest.get("checkpoints"))) | set(loop_steps)),
        "loop_checkpoints": loop_folder,
        "config": manifest.get("config"),
        "environment": manifest.get("environment"),
        "data": manifest.get("data"),
        "program_hash": manifest.get("program_hash"),
        "damage": [
            {"path": d.path, "offset": d.offset, "step": d.step, "reason": d.reason, "message": str(d)} for d in damage
        ],
        "verified": verify,
        "last_metrics": last,
        "sdc_checks": _sdc_checks(run, verify),
    }
    summary.update(_verdict(summary, damage, tail))
    summary["notes"] = list(run.notes) + summary["notes"]  # e.g. a manifest from before checksums
    if summary["problem"] and damage and status != "crashed":
        # A damaged run is never shown as "complete": its writer's word is kept apart.
        summary["writer_status"], summary["status"] = status, "damaged"
    return summary


def _sdc_checks(run, verify: bool) -> dict[str, Any] | None:
    """The in-training re-run checks (check.rerun_every, trainer/sdc.py) when the run has them.
    Their disagreements are listed only with --verify, which reads every record anyway: at a
    million steps that is the whole trace's tensor columns once; plain `show` stays O(segments)."""
    if not check_tensors(run.schema):
        return None  # and replay.verify (it imports JAX) is not needed
    from replay.verify import checks

    every = ((run.manifest.get("config") or {}).get("check") or {}).get("rerun_every")
    found = [d["line"] for d in checks.scan_run(run)] if verify else None
    return {"rerun_every": every, "disagreements": found}


def _found_damage(run, verify: bool, known: list) -> list:
    """What is known cheaply (`known`: headers, seals, missing leading segments, a short trace),
    plus, with `verify`, every record's checksum (the run's full check when traces has one)."""
    if not verify:
        return list(known)
    full = run.verify()
    seen = {(d.path, d.offset, d.reason) for d in full}
    return list(full) + [d for d in known if (d.path, d.offset, d.reason) not in seen]


def _metric_values(schema: traces.Schema, values: np.ndarray) -> list[dict[str, Any]]:
    """Each metric's exact value: shortest repr that round-trips its dtype, and its bits."""
    bits = values.view(np.uint32 if values.dtype.itemsize == 4 else np.uint64)
    width = values.dtype.itemsize * 2
    out = []
    for name, v, b in zip(schema.metric_names, values, bits):
        out.append(
            {
                "name": name,
                "value": float(v) if np.isfinite(v) else None,  # JSON has no NaN/inf
                "repr": str(v),  # numpy's shortest round-trip repr of the stored dtype: 'nan', '-0.0', '2.3025851'
                "bits": f"0x{int(b):0{width}x}",
            }
        )
    return out


def _checkpoint_steps(value: Any) -> list[int]:
    if not isinstance(value, list):
        return []
    steps = []
    for item in value:
        step = item.get("step") if isinstance(item, dict) else item
        if isinstance(step, int):
            steps.append(step)
    return sorted(steps)


def _loop_checkpoints(manifest: dict) -> tuple[str | None, list[int]]:
    """(folder, steps) of the loop's own checkpoints as its manifest lists them (replay.Loop(checkpoints=...)
    restores them; replay/maxtext/checkpoints.py LISTED_KEY), or (None, [])."""
    entry = manifest.get("loop_checkpoints")
    if not isinstance(entry, dict) or not isinstance(entry.get("directory"), str):
        return None, []
    return entry["directory"], _checkpoint_steps(entry.get("steps"))


def _verdict(summary: dict, damage: list[traces.Damage], tail: tuple[str, int] | None) -> dict[str, Any]:
    """`problem`: the one error line (exit 2) or None; `warnings` and `notes`: extra lines.

    Damage is told on the error line alone (the first, and how many more: --json lists them),
    so a damaged run is one line however many segments follow the damage."""
    path, status, steps = summary["path"], summary["status"], summary["steps"]
    readable = f"steps {steps['start']}..{steps['last']} are readable" if steps["count"] else "no step is readable"
    at_tail = [d for d in damage if tail is not None and status != "complete" and (d.path, d.offset) == tail]
    other = [d for d in damage if d not in at_tail]  # anything but the record a crash or a live writer left torn
    notes: list[str] = []
    problem = None
    if status == "crashed" and not other:
        where = "before recording any step" if not steps["count"] else f"after step {steps['last']}"
        detail = readable
        for d in at_tail:
            detail += f"; the damaged tail at {d.path} byte {d.offset} ({d.reason}) is dropped on resume"
        problem = (
            f"{path}: run crashed {where}: it is incomplete and no writer is running; {detail}. "
            f"Resume it with `replay train --resume {path}`"
        )
    elif other:
        more = f" (and {len(damage) - 1} more, see --json)" if len(damage) > 1 else ""
        problem = (
            f"{path}: the trace of this run is damaged ({other[0]}{more}); {readable}. "
            f"Restore the run's files from a copy, or record it again"
        )
    elif status == "running":
        notes.append(f"{path}: a live process is writing this run; this is a snapshot of the steps recorded so far")
        notes.extend(f"(expected while it writes) {d}" for d in at_tail)  # a record being written looks torn
    return {"problem": problem, "warnings": [], "notes": notes}


# ------------------------------------------------------------------------------ for people


def render(s: dict[str, Any]) -> None:
    steps, schema = s["steps"], s["schema"]
    status_style = {"complete": "green", "running": "cyan", "crashed": "bold red", "damaged": "bold red"}.get(s["status"], "")
    writer = {"complete": " (its writer had finished it cleanly)", "running": " (a live process is writing it)"}
    rows: list[tuple[str, Any]] = [
        ("status", console.styled(s["status"] + writer.get(s.get("writer_status"), ""), status_style)),
        ("format_version", s["format_version"]),
        ("steps", f"{steps['start']}..{steps['last']} ({steps['count']} steps)" if steps["count"] else "none recorded"),
        ("checkpoints", (_list_steps(s["checkpoints"]) if s["checkpoints"] else "none") + (
            f" (the loop's own, in {s['loop_checkpoints']})" if s.get("loop_checkpoints") else "")),
        ("examples per step", schema["examples_per_step"]),
        ("metrics", f"{', '.join(schema['metrics'])} ({schema['metric_dtype']})"),
        ("fingerprinted tensors", schema["tensors"]),
    ]
    if s["program_hash"] is not None:
        rows.append(("program hash", s["program_hash"]))
    sdc = s.get("sdc_checks")
    if sdc is not None:
        found = sdc["disagreements"]
        rows.append(("sdc re-run checks", f"one step in {sdc['rerun_every']}: " + (
            "--verify lists the re-runs that disagreed" if found is None else
            "every re-run agreed" if not found else f"{len(found)} disagreed: " + "; ".join(found[:3]))))
    if isinstance(s["config"], dict):
        flat = _flatten(s["config"])
        rows += [(f"config.{k}", _fmt(flat[k])) for k in CONFIG_KEYS if k in flat]
    for section in ("environment", "data"):
        if isinstance(s[section], dict):
            flat = _flatten(s[section])
            shown = list(flat.items())[:MAX_DETAIL_ROWS]
            rows += [(f"{section}.{k}", _fmt(v)) for k, v in shown]
            if len(flat) > len(shown):
                rows.append((f"{section}", f"... {len(flat) - len(shown)} more (see --json)"))
    console.print_table(rows, title=f"run {s['path']}")

    last = s["last_metrics"]
    if last:
        console.print_table(
            [(m["name"], m["repr"], m["bits"]) for m in last["metrics"]],
            columns=["metric", "value", "bits"],
            title=f"last metrics (step {last['step']})",
            justify=["left", "right", "left"],
        )


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, list):
        return ", ".join(map(str, v))
    return str(v)


def _list_steps(steps: list[int]) -> str:
    if len(steps) <= MAX_LISTED_CHECKPOINTS:
        return ", ".join(map(str, steps))
    half = MAX_LISTED_CHECKPOINTS // 2
    return ", ".join(map(str, steps[:half])) + f", ... ({len(steps) - 2 * half} more), " + ", ".join(map(str, steps[-half:]))
