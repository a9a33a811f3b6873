"""`bisect`: where two runs first part, and why, in causal order.

1. Manifest diff: what differs before any step ran (config, environment, data, program).
2. Trace scan (traces.compare): the first step where any recorded field differs, and the
   first field in causal order: data -> rng -> state -> forward -> loss -> backward -> update.
3. Refine data: which example positions differ, and for each differing example of either
   run whether that exact example was already seen, and where (run, step, position):
   repeated data makes a loss look better than it is.
4. Refine a layer (replay/bisect/refine.py): replay the step of both runs from their checkpoints and
   name the first intermediate inside the layer (or the first parameter, gradient or
   optimizer-state leaf) that differs, with its max abs, relative and ULP distances and the
   share of elements that differ. Any other loop's step is recomputed through its own program
   (and its code's taps, when its code runs here): the first field in causal order that differs.
   A step found by replay is described by its own fields, never by a later step's record.
5. Sparse traces (replay/bisect/refine.py): when the traces cannot localise the divergence -- no
   records at all (trace.level=off), or states that already differ entering the step the scan
   found -- compare the runs' states at common checkpoints, then binary-search the steps in
   between by replaying both runs (O(log N) probes). The divergent step is then the first step
   whose output state (parameters and optimizer state) differs.

Every replay is read-only and optional (`refine=False`, CLI --no-refine). When the answer needs
a replay (the traces cannot vouch for it) and the replay fails, the report keeps what the trace
scan found and `report.failure` holds the error, which the CLI raises after printing the report:
an unrefined answer is never passed off as a refined one. A damaged trace (allowed by the CLI's
--allow-damaged) is compared over its readable steps only, and the report says so.
"""

from __future__ import annotations


from replay.engine.contract import config_of, environment_differences, evaluate
from replay.bisect.data import SeenBefore, _data_at, seen_before  # noqa: F401 - re-exported
from replay.bisect.report import BisectReport, ManifestDiff, finite_json  # noqa: F401 - re-exported
from traces import Comparison, Run, compare
from traces.storage import is_url
from traces.schema import TENSOR_KINDS  # fields a replay can look inside (replay/bisect/refine.py)
from replay.engine.damage import bundle_terms, describe_damage, run_damage, shown_path
from replay.record.checkpoint_check import checkpoint_problem, listed_checkpoints
from replay.record.orbax_io import CheckpointDamagedError
from replay.engine.edits import describe, state_edits



def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def manifest_diff(a: dict, b: dict) -> list[ManifestDiff]:
    """Config, environment, data and program differences, in that order."""
    diffs: list[ManifestDiff] = []
    fa, fb = _flatten(config_of(a), "config."), _flatten(config_of(b), "config.")
    for key in list(fa) + [k for k in fb if k not in fa]:
        if key != "config.steps" and fa.get(key) != fb.get(key):
            diffs.append(ManifestDiff(key, fa.get(key), fb.get(key)))
    ea, eb = a.get("environment", {}), b.get("environment", {})
    # The contract's keys for A's backend, as `replay run` compares them (replay/engine/contract.py).

    for key, va, vb in environment_differences(ea, eb):
        diffs.append(ManifestDiff(f"environment.{key}", va, vb))
    va, vb = _flatten(ea.get("versions", {}), "versions."), _flatten(eb.get("versions", {}), "versions.")
    va.update(_flatten(ea.get("random", {}), "random."))
    vb.update(_flatten(eb.get("random", {}), "random."))
    for key in sorted(set(va) | set(vb)):
        if va.get(key) != vb.get(key):
            diffs.append(ManifestDiff(f"environment.{key}", va.get(key), vb.get(key)))
    da, db = a.get("data", {}), b.get("data", {})
    if da.get("fingerprint") != db.get("fingerprint"):
        diffs.append(ManifestDiff("data.fingerprint", da.get("fingerprint"), db.get("fingerprint")))
    if a.get("program_hash") != b.get("program_hash"):
        diffs.append(ManifestDiff("program_hash", (a.get("program_hash") or "")[:16], (b.get("program_hash") or "")[:16]))
    if a.get("faults") != b.get("faults"):
        diffs.append(ManifestDiff("faults", a.get("faults"), b.get("faults")))
    return diffs


def comparability_problem(a: Run, b: Run) -> str | None:
    """Why two runs cannot be bisected (another batch size, another model), or None."""
    sa, sb = a.schema, b.schema
    if sa.examples_per_step != sb.examples_per_step:
        return (f"the runs feed different batch sizes ({sa.examples_per_step} vs {sb.examples_per_step} examples "
                "a step): bisect compares two runs of the same training setup")
    if sa.tensors and sb.tensors and sa.tensor_names != sb.tensor_names:
        only = [n for n in sa.tensor_names if n not in sb.tensor_names][:1] or \
               [n for n in sb.tensor_names if n not in sa.tensor_names][:1]
        return (f"the runs record different models ({len(sa.tensors)} vs {len(sb.tensors)} fingerprinted tensors, "
                f"e.g. {only[0] if only else 'in another order'}): bisect compares two runs of the same model")
    return None


def bisect(run_a: Run, run_b: Run, refine: bool = True):
    """Manifest diff, first divergence in the traces, data refinement and, with `refine`, the
    replay steps: layer refinement and binary search by replay (replay/bisect/refine.py).

    A torch run (replay.torch) against a JAX run, in either order, is bisected across frameworks
    instead (replay/bisect/cross.py): a `CrossReport`, distances judged against a noise floor.
    Both reports have first_step, first_layer, cause, within_noise and to_json()."""
    from replay.bisect.cross import cross_bisect, is_cross

    if is_cross(run_a, run_b):
        return cross_bisect(run_a, run_b, refine=refine)

    report = BisectReport(shown_path(run_a), shown_path(run_b), manifest_diff(run_a.manifest, run_b.manifest),
                          compare(run_a.trace, run_b.trace))
    for name, run in (("A", run_a), ("B", run_b)):
        damage = run_damage(run)
        if damage:
            report.damage[name] = describe_damage(run, damage)
    from replay.bisect.replica import check_fault, hardware_fault, rerun_checks

    first_step = report.comparison.first_step
    report.rerun_checks = rerun_checks(run_a, run_b, first_step)
    report.hardware = hardware_fault(run_a, run_b, first_step) or check_fault(report.rerun_checks, first_step)
    first = report.comparison.first
    if first is None:
        _check_checkpoints(report, run_a, run_b)
    if first is not None and first.kind == "state" and report.hardware is None and _edits(report, run_a, run_b):
        return report  # the traces say it: one loop changed its state between two steps (no replay needed)
    if first is not None and first.kind == "data":
        _data_at(report, run_a, run_b, report.comparison.first_step, first.positions or [])
    report.bits_expected = _bits_expected(run_a, run_b)
    if first is not None and not report.bits_expected and first.kind not in ("data", "rng"):
        # Another backend or device count: bits were never promised, so judge the difference
        # against the noise floor instead of replaying both runs here (which would agree).
        if refine:
            _noise(report, run_a, run_b)
        else:
            report.notes.append("bits are not expected to match for this pair; --no-refine skips the noise floor")
    elif refine:
        _replay(report, run_a, run_b)
    elif _needs_replay(report, run_a, run_b):
        c = report.comparison
        report.notes.append("the traces record no step both runs took (trace.level=off?) and --no-refine allows no "
                            "replay to compare checkpoints" if c.compared[1] <= c.compared[0] else
                            "trace scan only (--no-refine): the traces alone do not show every step's state, so "
                            "a divergence they do not record would go unnoticed")
    return report


def _edits(report: BisectReport, run_a: Run, run_b: Run) -> bool:
    """The divergence begins with the state entering a step: did one run's loop edit it there?"""
    step = report.comparison.first_step
    for name, run in (("B", run_b), ("A", run_a)):
        leaves = state_edits(run, step)
        if leaves:
            report.edits = {"run": name, "step": step, "leaves": leaves}
            report.notes.append(describe(leaves, step, name) + "; every step before it computes the same bits in "
                                "both runs, so the difference is the loop's edit, not a step's computation")
            return True
    return False


def _check_checkpoints(report: BisectReport, run_a: Run, run_b: Run) -> None:
    """Traces that agree say nothing of the checkpoint files: before an agreeing verdict, every
    listed checkpoint of both runs is checked present and structurally intact, cheaply (no
    restore, no array bytes: replay/record/checkpoint_check.py, O(chunks) per checkpoint), and a
    damaged one is refused here, before any report. Their contents stay unread, and the
    verdict says so (`checkpoint_note`)."""
    # A run on object storage: its checkpoints are read (orbax, tensorstore) in issue 35's next slice;
    # until then they are named unchecked, never called intact.
    unchecked = [name for name, run in (("A", run_a), ("B", run_b)) if is_url(run.path) and listed_checkpoints(run)]
    for name, run in (("A", run_a), ("B", run_b)):
        problem = None if is_url(run.path) else checkpoint_problem(run)
        if problem:
            raise CheckpointDamagedError(f"run {name}: {bundle_terms(run, problem)}")
    report.checkpoints = {"A": len(listed_checkpoints(run_a)), "B": len(listed_checkpoints(run_b)),
                          "checked": "structure", "contents_compared": False, **({"unchecked": unchecked} if unchecked else {})}


def _bits_expected(run_a: Run, run_b: Run) -> bool:
    mesh = [config_of(r.manifest).get("mesh", {}).get("mesh_invariant", False) for r in (run_a, run_b)]
    counts = tuple(run_a.manifest.get("invariant_device_counts", ()))
    contract = evaluate(run_a.manifest.get("environment", {}), run_b.manifest.get("environment", {}),
                        None, None, all(mesh), counts)
    return contract.expect_bits


NOISE_WINDOW = 200  # steps after the first difference judged against the floor (bounds the replay)


def _noise(report: BisectReport, run_a: Run, run_b: Run) -> None:
    from replay.engine.noise import judge
    from replay.engine.replayer import ReplayUnavailable, _checkpoint_error, _input_errors

    c = report.comparison
    start, stop = c.first_step, min(c.compared[1], c.first_step + NOISE_WINDOW)
    try:
        verdict = judge(run_a, run_b, start, stop)
    except _checkpoint_error() as e:  # a damaged checkpoint is named as itself
        report.failure = e
        return
    except (ReplayUnavailable, *_input_errors()) as e:  # data, checkpoints or config missing here
        report.failure = ReplayUnavailable(
            f"bits are not expected to match for this pair, and the noise floor that would judge the differences "
            f"from step {start} on could not be measured here ({type(e).__name__}: {e}); fix that and rerun, or pass "
            "--no-refine to report the differences unjudged")
        return
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint (exit 2) or a bug (exit 3), raised by the CLI
        report.failure = e
        return
    report.noise = verdict.to_json()
    report.noise["because"] = _why_no_bits(run_a, run_b)
    report.noise["inputs"] = _inputs(run_a, run_b, start, stop)
    report.replays += verdict.replays


def _why_no_bits(run_a: Run, run_b: Run) -> list[dict]:
    """The environment keys that withdraw the bit promise for this pair (process_count 2 vs 1, ...)."""
    contract = evaluate(run_a.manifest.get("environment", {}), run_b.manifest.get("environment", {}), None, None)
    return [{"key": k, "a": a, "b": b} for k, a, b in contract.differences]


def _inputs(run_a: Run, run_b: Run, start: int, stop: int) -> dict:
    """Whether both runs fed the same data and RNG over [start, stop): rounding noise explains only
    differences of what the steps computed, never of what they were fed. Reads 2 x (stop - start)
    records (stop - start <= NOISE_WINDOW)."""
    for step in range(start, stop):
        ra, rb = run_a.trace.read(step), run_b.trace.read(step)
        for kind, x, y in (("data", ra.example_hashes, rb.example_hashes), ("rng", ra.rng, rb.rng)):
            if x.shape != y.shape or not (x == y).all():
                return {"equal": False, "step": step, "kind": kind, "steps": [start, stop]}
    return {"equal": True, "steps": [start, stop]}


def _run_steps(run: Run) -> int:
    """The steps the run took: its config's, or what its trace holds."""
    steps = config_of(run.manifest).get("steps")
    return int(steps) if isinstance(steps, int) else run.trace.end


def _trace_vouches(run_a: Run, run_b: Run, c: Comparison) -> bool:
    """True when equal traces mean equal runs: both record their state's fingerprints at every
    step (trace.level=layer, layer_every=1) over every step both took."""
    for run in (run_a, run_b):
        every = config_of(run.manifest).get("trace", {}).get("layer_every", 1)
        if "state/params" not in run.schema.tensor_names or every != 1:
            return False
    return c.compared[0] == 0 and c.compared[1] >= min(_run_steps(run_a), _run_steps(run_b))


def _needs_replay(report: BisectReport, run_a: Run, run_b: Run) -> bool:
    first = report.comparison.first
    if first is None:
        return not _trace_vouches(run_a, run_b, report.comparison)
    return first.kind not in ("data", "rng")


def _replay(report: BisectReport, run_a: Run, run_b: Run) -> None:
    """Steps 4 and 5: confirm the divergent step by replay (or find it), then recompute it."""
    from replay.bisect.refine import (ReplayUnavailable, Replayer, first_state_difference, refine_step,
                               search_first_divergence)
    from replay.bisect.refine_loop import refine_loop_step
    from replay.engine.recompute import recomputes

    if not _needs_replay(report, run_a, run_b):
        return  # the trace names an input of the step (data, rng), or vouches for identical runs
    c = report.comparison
    first = c.first
    ra, rb = Replayer("A", run_a), Replayer("B", run_b)
    try:
        if first is None:
            # Nothing recorded differs, but the traces do not show the states: compare checkpoints.
            search = search_first_divergence(ra, rb, end=min(_run_steps(run_a), _run_steps(run_b)))
            report.search, report.replays = search.to_json(), report.replays + search.replays
            report.notes.extend(search.notes)
            if search.first_step is None:
                report.method = "checkpoint comparison"
                return
            report.method, report.found_step = "binary search by replay", search.first_step
            step, states, focus = search.first_step, search.states, None
        else:
            step = c.first_step
            (_, sa), (_, sb) = ra.state_at(step), rb.state_at(step)
            report.replays += 1
            leaf = first_state_difference(sa, sb)
            if leaf is None:
                states = (sa, sb)
                tensor = first.name in run_a.schema.tensor_names and first.kind in TENSOR_KINDS
                focus = (first.kind, first.name) if tensor else None
            else:
                # The trace scan found a step the states already differ entering (a sparse trace).
                report.notes.append(f"the states already differ entering step {step} ({leaf}), the first step the "
                                    "trace records a difference at: searching the steps before it by replay")
                search = search_first_divergence(ra, rb, upper=step)
                report.search, report.replays = search.to_json(), report.replays + search.replays
                report.notes.extend(search.notes)
                if search.first_step is None:
                    return
                report.method, report.found_step = "binary search by replay", search.first_step
                step, states, focus = search.first_step, search.states, None
        if not (recomputes(ra) and recomputes(rb)):
            # A loop without recompute_step: its own step re-run on both states, its taps recomputed with its code.
            report.refinement = refine_loop_step(ra, rb, step, states, focus)
        else:
            report.refinement = refine_step(ra, rb, step, states, focus)
        if report.refinement.get("cause") == "data":
            _data_at(report, run_a, run_b, step, report.refinement.get("positions") or [])
        if report.refinement.get("cause") == "data" and not report.examples:
            report.notes.append("the traces hold no per-example hashes of earlier steps: whether these examples "
                                "were already seen is not known (record with trace.level=step or layer)")
    except ReplayUnavailable as e:
        why = ("the traces do not show every step's state, so a replay has to check them"
               if c.first is None else f"the trace scan's step {c.first_step} needs a replay to be confirmed and refined")
        report.failure = ReplayUnavailable(f"bisect could not replay the runs here: {e} ({why}); fix that and rerun, "
                                           "or pass --no-refine for the trace scan alone")
        report.failure.__cause__ = e
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint (exit 2) or a bug (exit 3), raised by the CLI
        report.failure = e  # after the report, so the trace scan's answer is not lost
    finally:
        report.replayed_steps = ra.replayed_steps + rb.replayed_steps
        _processes_note(report, run_a, run_b)


def _processes_note(report: BisectReport, run_a: Run, run_b: Run) -> None:
    """Bisect replays in this one process: a run recorded on several is replayed measured only."""
    import jax

    counts = {n: (r.manifest.get("environment") or {}).get("process_count") for n, r in (("A", run_a), ("B", run_b))}
    other = {n: c for n, c in counts.items() if isinstance(c, int) and c != jax.process_count()}
    if report.replays and other:
        who = (f"both runs were recorded on {other['A']} processes" if other.get("A") == other.get("B") else
               " and ".join(f"{n} was recorded on {c} processes" for n, c in other.items()))
        report.notes.append(f"{who}, replayed here in {jax.process_count()}: bisect's replays "
                            "compare the two runs replayed alike, measured, not bit for bit against their traces "
                            "(replay run on as many processes checks those bits)")
