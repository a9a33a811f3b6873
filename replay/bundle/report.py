"""The REPORT.md of a bug-report bundle (`replay pack`): a bug report people can read, whose
numbers come from the bundle's own trace. The bundle format: replay/bundle/format.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np

import traces
from replay.bundle.format import FORMAT_VERSION

FINDING_ROWS = 12  # fields of the divergent step listed in REPORT.md
MAX_TABLE_ROWS = 60  # REPORT.md metric rows; longer ranges are sampled evenly (A and B always shown)


def _short(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _num(v) -> str:
    """A recorded float as its shortest exact repr in its stored dtype ('nan', '-0.0', '2.3025851')."""
    return str(np.asarray(v)[()]) if isinstance(v, np.generic) or isinstance(v, np.ndarray) else repr(v)


def _rows(pairs: Iterable[tuple[str, Any]]) -> list[str]:
    lines = ["| | |", "| --- | --- |"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in pairs]
    return lines


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def sample_steps(first: int, last: int, keep: Iterable[int] = (), most: int = MAX_TABLE_ROWS) -> list[int]:
    """All steps first..last, or `most` of them evenly spaced with first, last and `keep` included."""
    n = last - first + 1
    if n <= most:
        return list(range(first, last + 1))
    picked = {int(round(first + i * (n - 1) / (most - 1))) for i in range(most)}
    picked |= {s for s in keep if first <= s <= last}
    return sorted(picked)


def render_report(manifest: dict, schema: traces.Schema, trace: traces.TraceReader, bundle_name: str, *,
                  finding: dict | None = None) -> str:
    """The bundle's REPORT.md: a bug report people can read, whose numbers come from `trace` (the
    bundle's own)."""
    info = manifest["bundle"]
    cfg = manifest.get("config") or {}
    env = manifest.get("environment") or {}
    data = manifest.get("data") or {}
    first, last = info["steps"]
    ckpt, lite = info["checkpoint"], info["lite"]
    keep = [finding["step"]] if finding and finding.get("step") is not None else []
    shown = sample_steps(first, last, keep)
    by_step = {s: trace.read(s) for s in {first, last, *shown}}
    name = Path(info["packed_from"]).name
    model, dcfg, opt, tcfg = (cfg.get(k, {}) for k in ("model", "data", "optimizer", "trace"))
    L: list[str] = [f"# Bug report: steps {first}..{last} of `{name}`", ""]
    L.append(f"A `replay pack` bundle (bundle format_version {FORMAT_VERSION}), "
             + ("**lite**: the trace and this report only, to compare, not to replay."
                if lite else "with everything needed to replay these steps bit for bit on another machine, "
                             "without the dataset or the run folder."))
    L.append("")
    L.append("## Summary")
    L.append("")
    src = info["source_steps"]
    params = (manifest.get("model") or {}).get("params")
    L.append(f"- Run: `{info['packed_from']}`, preset `{manifest.get('preset') or 'custom'}`"
             + (f", {params:,} parameters" if isinstance(params, int) else "")
             + f"; {cfg.get('steps', '?')} steps configured, steps {src[0]}..{src[1]} recorded ({info['source_status']}).")
    L.append(f"- Steps covered: {first}..{last} ({last - first + 1} steps)"
             + ("." if lite else f", replayed from the checkpoint at step {ckpt}."))
    if "loss" in schema.metric_names:
        i = schema.metric_index("loss")
        vals = np.array([r.metrics[i] for r in trace.records(first, last + 1)])
        finite = vals[np.isfinite(vals)]
        span = f" (min {_num(finite.min())}, max {_num(finite.max())})" if finite.size else ""
        L.append(f"- Loss: {_num(vals[0])} at step {first}, {_num(vals[-1])} at step {last}{span}.")
    if finding:
        L.append(f"- Finding: {finding['headline']}.")
    L.append("")
    L.append("## The run")
    L.append("")
    rows: list[tuple[str, Any]] = [("preset", manifest.get("preset") or "custom"), ("seed", cfg.get("seed"))]
    if model:
        rows.append(("model", f"{model.get('n_layers')} layers, d_model {model.get('d_model')}, {model.get('n_heads')} heads "
                              f"({model.get('n_kv_heads')} kv), d_ff {model.get('d_ff')}, vocab {model.get('vocab_size')}, "
                              f"seq_len {model.get('seq_len')}, {model.get('dtype')} (params {model.get('param_dtype')}), "
                              f"dropout {model.get('dropout')}"))
    if params is not None:
        rows.append(("parameters", f"{params:,}" if isinstance(params, int) else params))
    if dcfg:
        rows.append(("batch", f"{dcfg.get('global_batch_size')} examples x {model.get('seq_len')} tokens"))
    if opt:
        rows.append(("optimizer", f"AdamW lr {opt.get('lr')}, warmup {opt.get('warmup_steps')}, decay {opt.get('decay_steps')}, "
                                  f"weight decay {opt.get('weight_decay')}, clip {opt.get('grad_clip')}, z_loss {opt.get('z_loss')}"))
    if data:
        rows.append(("data", f"{data.get('path')} ({data.get('kind')}, {data.get('dtype')}, {data.get('n_tokens')} tokens, "
                             f"fingerprint {str(data.get('fingerprint'))[:16]})"))
    if tcfg:
        every = tcfg.get("layer_every")
        rows.append(("trace level", f"{tcfg.get('level')}" + ("" if tcfg.get("level") != "layer" else
                                                              " (layer fingerprints every step)" if every == 1 else
                                                              f" (layer fingerprints every {every} steps)")))
    mesh = cfg.get("mesh") or {}
    if mesh:
        rows.append(("mesh", f"data {mesh.get('data')}, fsdp {mesh.get('fsdp')}, mesh_invariant {mesh.get('mesh_invariant')}"))
    rows.append(("faults injected", ", ".join(manifest.get("faults") or []) or "none"))
    rows.append(("steps recorded", f"{src[0]}..{src[1]} ({info['source_status']})"))
    if manifest.get("program_hash"):
        rows.append(("program hash", manifest["program_hash"][:16]))
    L += _rows(rows)
    L.append("")
    L.append("## Environment")
    L.append("")
    versions = env.get("versions") or {}
    erows: list[tuple[str, Any]] = [("backend", env.get("backend"))]
    if env.get("device_kind") is not None:
        procs = env.get("process_count")
        erows.append(("devices", f"{env.get('device_count')} x {env.get('device_kind')}, "
                                 f"{procs} process{'' if procs == 1 else 'es'}"))
    if manifest.get("mesh"):
        erows.append(("mesh shape", ", ".join(f"{k} {v}" for k, v in manifest["mesh"].get("shape", {}).items())))
    erows += [(k, v) for k, v in versions.items()]
    erows += [("cpus", env.get("cpu_count")), ("platform", env.get("platform")), ("XLA_FLAGS", env.get("xla_flags") or "(none)")]
    L += _rows([(k, v) for k, v in erows if v is not None])
    L.append("")
    L.append("## Steps covered")
    L.append("")
    L.append(f"- Range: steps {first}..{last} ({last - first + 1} steps).")
    if lite:
        L.append(f"- The bundle holds the trace records of steps {first}..{last}: every recorded field, bit for bit "
                 "(RNG key words, batch and per-example hashes, metrics"
                 + (", layer fingerprints" if schema.tensors else "") + "). No checkpoint and no batch data.")
    else:
        L.append(f"- Checkpoint: step {ckpt}, the newest at or before step {first}."
                 + (f" The replay re-runs steps {ckpt}..{first - 1} first and verifies them too." if ckpt < first else ""))
        L.append(f"- The bundle holds the trace records of steps {ckpt}..{last}, checkpoint {ckpt}, and the token rows of "
                 f"the {info['example_count']} examples that the batches of steps {ckpt}..{last} are made of.")
    L.append("")
    L.append("## Metrics")
    L.append("")
    names = list(schema.metric_names)
    if len(shown) < last - first + 1:
        L.append(f"{len(shown)} of the {last - first + 1} steps, evenly spaced; every step is in the trace "
                 f"(`replay show {bundle_name} --json`, or unpack it).")
        L.append("")
    L.append("| step | " + " | ".join(names) + " | batch hash |")
    L.append("| ---: | " + " | ".join("---:" for _ in names) + " | --- |")
    for s in shown:
        r = by_step[s]
        L.append(f"| {s} | " + " | ".join(_num(v) for v in r.metrics) + f" | {r.batch_hash:016x} |")
    L.append("")
    L.append(f"Values are the exact recorded {schema.metric_dtype} values (shortest round-trip form).")
    L.append("")
    if finding:
        L += _render_finding(finding)
    L.append("## How to replay")
    L.append("")
    if lite:
        L.append("This bundle holds no checkpoint or data, so it does not replay. Look at it or compare it with a run:")
        L.append("")
        L.append("```bash")
        L.append(f"replay show {bundle_name}")
        L.append(f"replay bisect {bundle_name} YOUR_RUN --no-refine    # where your run first differs from these steps")
        L.append("```")
    else:
        L.append("```bash")
        L.append("pip install replay-jax    # the replay that packed it, or newer")
        L.append(f"replay run {bundle_name} --steps {first}:{last}")
        L.append("```")
        L.append("")
        warm = f" (and the {first - ckpt} warm-up steps {ckpt}..{first - 1} bit-identical)" if first > ckpt else ""
        L.append(f"Expected: `{last - first + 1} of {last - first + 1}` steps bit-exact{warm} on a machine that matches the environment above "
                 "(backend, device kind and count, software versions). Anywhere else `replay run` says which line "
                 "of the determinism contract applies and reports distances instead of promising bits.")
        L.append("")
        L.append("```bash")
        L.append(f"replay show {bundle_name}                 # the run and its recorded steps")
        L.append(f"replay bisect {bundle_name} YOUR_RUN      # compare with your own run of the same config")
        L.append("```")
    L.append("")
    L.append(f"`replay unpack {bundle_name} DIR` writes the files out: DIR is a run folder (run.json, trace/"
             + ("" if lite else ", checkpoints/, data/") + ") holding this report.")
    L.append("")
    return "\n".join(L)


def _value(v: Any) -> str:
    """A compared value: floats (float32 metrics and RMS) in their shortest float32 form."""
    if v is None:
        return ""
    if isinstance(v, float):
        return str(np.float32(v)) if np.float32(v) == v or not math.isfinite(v) else repr(v)
    return _cell(v)


def _render_finding(f: dict) -> list[str]:
    L = ["## Finding", ""]
    if f["kind"] == "bisect":
        L.append(f"From `replay bisect {f['run_a']} {f['run_b']}` (A is this run): {f['headline']}.")
        L.append("")
        if f["manifest_diff"]:
            L.append("What differs before any step ran:")
            L.append("")
            L.append("| | A | B |")
            L.append("| --- | --- | --- |")
            L += [f"| {_cell(k)} | {_cell(a)} | {_cell(b)} |" for k, a, b in f["manifest_diff"]]
            L.append("")
        if not f["identical"]:
            rows = [("first divergent step", f["step"]), ("cause (first field in causal order)", f["cause"])]
            if f["layer"]:
                rows.append(("layer", f["layer"]))
            first = f["fields"][0] if f["fields"] else None
            if f["cause"] == "data" and first and first.get("positions"):
                pos = first["positions"]
                rows.append(("examples that differ", f"{len(pos)} of the batch, at positions {', '.join(map(str, pos[:24]))}"))
            for run in ("b", "a"):
                rep = f[f"repeated_in_{run}"]
                if rep:
                    steps = sorted({s["step"] for e in rep for s in e["seen"] if s["run"] == run.upper()})
                    rows.append((f"already seen by {run.upper()}", f"{len(rep)} of them, first fed at steps "
                                                                   f"{', '.join(map(str, steps[:12]))}: repeated data"))
            L += _rows(rows)
            L.append("")
            L.append(f"Fields that differ at step {f['step']}, in causal order (the first is the likely cause, the "
                     "rest its consequences; for tensors the values are RMS, the trace holds their fingerprints):")
            L.append("")
            L.append("| kind | field | A | B | distance |")
            L.append("| --- | --- | --- | --- | --- |")
            shown = f["fields"][:FINDING_ROWS]
            for d in shown:
                dist = d.get("distance") or {}
                ds = "" if not dist or dist.get("nan") else f"abs {dist.get('abs'):.3g}, ulp {dist.get('ulp')}"
                L.append(f"| {d['kind']} | {_cell(d['name'])} | {_value(d['a'])} | {_value(d['b'])} | {ds} |")
            more = len(f["fields"]) - len(shown) + f["more_fields"]
            if more:
                L.append(f"| ... | {more} more fields | | | |")
            L.append("")
        if f.get("refinement"):
            L.append("Inside the layer: " + ", ".join(f"{k} {v}" for k, v in f["refinement"].items()
                                                   if not isinstance(v, (list, dict))) + ".")
            L.append("")
        L.append(f"To compare again elsewhere, pack {f['run_b']} the same way and run `replay bisect A.rpk B.rpk`.")
        L.append("")
    else:
        L += _render_spike(f)
    return L


def _render_spike(f: dict) -> list[str]:
    L = [f"From `replay spike {f['run']} --step {f['step']} --window {f['window']}`: {f['headline']}.", ""]
    loss, grad, rep = f.get("loss") or {}, f.get("grad_norm"), f.get("replay") or {}
    rows: list[tuple[str, Any]] = [
        ("step", f["step"]),
        ("loss", f"{_value(loss.get('loss'))} (baseline {_short(loss.get('baseline'))}, spread {_short(loss.get('spread'))}, "
                 f"score {_short(loss.get('score'))}, rise {_short(loss.get('rise'))})"),
        ("detected", "yes" if f.get("detected") else f"no (spikes found: {', '.join(map(str, f.get('spikes', []))) or 'none'})"),
    ]
    if grad:
        rows.append(("grad norm", f"{_value(grad.get('loss'))} (baseline {_short(grad.get('baseline'))}, "
                                  f"score {_short(grad.get('score'))})"))
    jump = f.get("first_jump")
    rows.append(("first layer to jump", f"{jump['name']} ({jump['kind']}): RMS x{_short(jump['ratio'])}, score "
                                        f"{_short(jump['score'])}" if jump else "none above the threshold"))
    if f.get("injected_positions"):
        rows.append(("injected bad examples", ", ".join(map(str, f["injected_positions"]))))
    if rep:
        rows.append(("replay on the packing machine", f"{rep.get('bit_exact')} of {rep.get('replayed')} bit-identical "
                                                      f"from checkpoint {rep.get('checkpoint')} ({rep.get('warmup_bit_exact')} "
                                                      f"of {rep.get('warmup_replayed')} warm-up); {rep.get('contract')}"))
    L += _rows(rows)
    L.append("")
    if f.get("examples"):
        L.append(f"Examples with the largest loss at step {f['step']} (typical example loss "
                 f"{_short(f.get('typical_example_loss'))}):")
        L.append("")
        L.append("| position | loss | score | share of the rise | hash | seen before at step | first tokens |")
        L.append("| ---: | ---: | ---: | ---: | --- | ---: | --- |")
        for e in f["examples"]:
            text = e.get("text")
            L.append(f"| {e['position']} | {_short(e['loss'])} | {_short(e['score'])} | {_short(e['share_of_rise'])} | "
                     f"{e['hash']} | {'' if e['seen_before'] is None else e['seen_before']} | "
                     f"{'' if text is None else _cell(repr(text[:40]))} |")
        L.append("")
    for note in f.get("notes", []):
        L.append(f"- {note}")
    if f.get("notes"):
        L.append("")
    return L
