"""`replay bisect RUN_A RUN_B`: where two runs first part, and why."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Annotated, Optional

import typer

from replay.cli import console
from replay.engine.human_names import namer
from replay.errors import EXIT_DIVERGED
from replay.cli.bisect_cross import run_cross
from replay.engine.code import allowing


def bisect(
    run_a: Annotated[Path, typer.Argument(help="The reference run.")],
    run_b: Annotated[Path, typer.Argument(help="The run to compare with it.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write both loss curves and their difference to this PNG "
                                                 "(across frameworks: a heat map of every layer's distance over steps).")] = None,
    no_refine: Annotated[bool, typer.Option("--no-refine", help="Trace scan only: no replays (no layer refinement, "
                                                                "no binary search over sparse traces).")] = False,
    allow_incomplete: Annotated[bool, typer.Option("--allow-incomplete", help="Compare a crashed run's readable "
                                                                              "steps anyway.")] = False,
    allow_damaged: Annotated[bool, typer.Option("--allow-damaged", help="Compare the steps a damaged trace can still "
                                                                        "read (the report says which).")] = False,
    allow_code: Annotated[bool, typer.Option("--allow-code", help="Run the training-loop code the run's manifest "
                                             "names from a folder it names: your own "
                                             "checkout, never a bundle's or the run's own folder.")] = False,
    floor: Annotated[Optional[str], typer.Option("--floor", help="Across frameworks: the noise floor, a measured table "
                                                 "by name (trainer, olmo3-pair) or a JSON file (bench/cross_noise_pair.py "
                                                 "prints one), or twin:PATH (a twin of one side differing by rounding "
                                                 "only: replay/bisect/twin_floor.py); "
                                                 "default auto: the pair's own where measured, else trainer.")] = None,
) -> None:
    """Name the first step, field and cause where two runs differ.

    Reads both traces; where they name a layer (or cannot localise the divergence: runs recorded
    sparsely or not at all), replays both runs from their checkpoints, read-only, to name the
    first intermediate that differs, or to find the divergent step by binary search. A replay
    the answer needs that fails is an error (after the trace scan's report), not a note.

    Runs in one process, also for runs recorded on several: the trace scan and the noise floor
    need no other, and refining replays run here, the two runs alike, measured against each
    other rather than bit for bit against their traces (a note says so). A pair whose bits the
    contract does not promise (another process or device count) and whose differences stay
    within the noise floor, with equal data and RNG, is cause `environment`, naming the keys.
    """
    from replay.bisect import bisect as run_bisect
    from replay.bundle import open_run
    from replay.engine.damage import named_as_bundle

    from traces.storage import is_url, shown

    console.local_output("--plot", plot)
    if (is_url(run_a) and shown(run_a) == shown(run_b)) or (
            run_a.exists() and run_b.exists() and run_a.resolve() == run_b.resolve()):
        console.fail(f"{shown(run_a)} and {shown(run_b)} are the same run; bisect compares two different runs "
                     "(to check one run against itself, replay it: replay run RUN)")
    a, b = open_run(run_a), open_run(run_b)  # run folders, or bundles (`replay pack`)
    from replay.bisect.cross import is_cross

    if is_cross(a, b):  # a torch run against a JAX run: distances against the noise floor

        _check_comparable(a, b, allow_incomplete, allow_damaged, names=False)
        with named_as_bundle(a), named_as_bundle(b), allowing(allow_code):
            run_cross(a, b, json_out=json_out, plot=plot, no_refine=no_refine, floor=floor)
        return
    if floor is not None:  # the same framework: the floor is measured by replaying both runs (replay/engine/noise.py)
        console.fail(f"--floor sets the noise floor of a bisect across frameworks (a torch run against a JAX run); "
                     f"{shown(run_a)} and {shown(run_b)} are recorded by the same framework")
    _check_comparable(a, b, allow_incomplete, allow_damaged)
    with named_as_bundle(a), named_as_bundle(b), allowing(allow_code):  # replays load each run's own code
        report = run_bisect(a, b, refine=not no_refine)
    report.notes.extend(f"{name}: {note}" for name, run in (("A", a), ("B", b)) for note in run.notes)
    if plot is not None:
        from replay.plot import plot_divergence

        plot_divergence(a, b, report.first_step, plot)
        report.notes.append(f"plot written to {plot}")
    c = report.comparison
    if (report.failure is None and report.identical and c.compared[1] <= c.compared[0]
            and report.method != "checkpoint comparison"):
        why = "; ".join(list(report.damage.values()) + report.notes) or "no replay was possible"
        console.fail(f"nothing to compare: the traces of {run_a} and {run_b} hold no step in common ({why})")
    if json_out:
        console.print_json(report.to_json())
    else:
        render(report, namer(a.manifest))
    if report.failure is not None:
        with named_as_bundle(a), named_as_bundle(b):
            raise report.failure  # one error line after the trace scan's report: 2 bad input, 3 a bug
    if not report.identical and not report.noise_only:  # noise the contract allows is not a divergence
        raise typer.Exit(EXIT_DIVERGED)


def _check_comparable(a, b, allow_incomplete: bool, allow_damaged: bool, names: bool = True) -> None:
    """Bad input for a bisect: one line, exit 2."""
    from replay.bisect import comparability_problem
    from replay.engine.damage import damage_error, shown_path

    for name, run in (("A", a), ("B", b)):
        if run.status == "crashed" and not allow_incomplete:
            console.fail(f"run {name} ({shown_path(run)}) crashed before finishing; resume it (replay train --resume "
                         f"{shown_path(run)}) or pass --allow-incomplete to compare the steps it recorded")
        damaged = None if allow_damaged else damage_error(
            run, f"run {name} ({shown_path(run)})", "pass --allow-damaged to compare the steps it can read")
        if damaged:
            raise damaged
    problem = comparability_problem(a, b) if names else None  # across frameworks: names are compared by bisect
    if problem:
        console.fail(problem)


def _num(x) -> str:
    return "" if x is None else f"{x:.6g}" if isinstance(x, float) else str(x)


def render(report, shown: Callable[[str], str] = str) -> None:
    """The report for people; `shown`: the display name of a recorded tensor (replay/engine/human_names.py)."""
    if report.manifest:
        console.print_table([(m.key, str(m.a), str(m.b)) for m in report.manifest[:30]],
                            columns=("what differs before any step ran", "A", "B"))
    c = report.comparison
    if report.identical and not report.whole:
        _render_partial(report)
        return
    if report.identical:
        if c.compared[1] > c.compared[0]:
            console.print_text(f"identical: steps {c.compared[0]}..{c.compared[1] - 1} are bit-identical in both runs "
                               f"(A holds {c.a_range[0]}..{c.a_range[1] - 1}, B {c.b_range[0]}..{c.b_range[1] - 1})",
                               style="green")
        if report.checkpoint_note:  # never let "identical" speak for checkpoint contents it did not read
            console.print_text(report.checkpoint_note)
        if report.method == "checkpoint comparison":
            console.print_text(f"identical: {'; '.join(report.notes) or 'the states at the common checkpoints are equal'}",
                               style="green")
        else:
            for note in report.notes:
                console.status(note)
        return
    rows = [("first divergent step", str(report.first_step)), ("cause", report.cause or "")]
    if report.hardware is not None:
        rows.append(("hardware", report.hardware["line"]))
    for name, check in report.rerun_checks.items():  # the in-training SDC re-run (check.rerun_every)
        rows.append((f"run {name}'s re-run check at step {check['step']}", check["line"]))
    rows += [(f"run {name}'s trace is damaged", line) for name, line in report.damage.items()]
    if report.failure is not None:
        rows.append(("not confirmed by replay", "the replay this answer needs failed (the error below)"))
    if report.layer:
        rows.append(("layer", shown(report.layer)))
    r = report.refinement or {}
    if r.get("first_intermediate"):
        rows.append(("first intermediate that differs" if r.get("cause") == "forward" else "first tensor that differs",
                     shown(r["first_intermediate"])))
    op = r.get("op") or {}
    if op.get("op"):
        rows.append(("first op that differs", f"{op['op']} at {op.get('where')}"))
        rows.append(("why", str(op.get("reason"))))
    first = c.first
    if report.cause == "data":
        positions = first.positions if first is not None and first.kind == "data" else r.get("positions") or []
        rows.append(("examples that differ", f"{len(positions)} of the batch: {', '.join(map(str, positions[:24]))}"))
        p = report.permutation
        if p is not None:
            rows.append(("same examples, another order", f"B's batch is a permutation of A's ({p['moved']} of "
                                                         f"{p['examples']} moved): no new data"))
        for run in ("B", "A"):
            rep = report.repeated(run)
            if rep:
                where = sorted({s["step"] for e in rep for s in e.seen if s["run"] == run and s.get("same_epoch", True)})
                rows.append((f"already seen by {run}", f"{len(rep)} of them, first fed at steps {', '.join(map(str, where[:12]))}"))
    method = report.method
    if r.get("found_by") == "replay" and method == "trace scan":
        method = "trace scan (step); replay (cause and layer)"
    rows.append(("found by", method))
    rows.append(("replays", f"{report.replays}" + (f" ({report.replayed_steps} steps re-run)" if report.replayed_steps else "")))
    if report.search:
        probes = report.search["probes"]
        rows.append(("probes", ", ".join(f"{p['step']}{'=' if p['equal'] else '≠'}{'c' if p['how'] == 'checkpoint' else ''}"
                                         for p in probes[:24]) + "  (= equal, ≠ differs, c: checkpoint)"))
    n = report.noise
    if n is not None:
        if n["above"]:
            rows.append(("above the noise floor", f"step {n['first_step']}, {n['kind']} {n['field']}: "
                                                  f"{n['ratio']:.0f}x the floor (distance {n['distance']:.3g}, floor {n['floor']:.3g})"))
        inputs = n.get("inputs") or {}
        if inputs.get("equal") is False:  # rounding never changes what a step is fed
            rows.append(("fed differently", f"step {inputs['step']}: the runs' {inputs['kind']} differ, which the "
                                            "environment's rounding cannot explain: a real divergence"))
        elif not n["above"]:
            because = "; ".join(f"{d['key']} {d['a']} vs {d['b']}" for d in n.get("because") or []) \
                or "another backend or device count"
            fed = " the runs fed equal data and RNG, and" if inputs.get("equal") else ""
            rows.append(("verdict", f"numerical noise only: bits are not expected to match for this pair ({because}), "
                                    f"and over steps {n['steps'][0]}..{n['steps'][1] - 1}{fed} no recorded quantity "
                                    f"exceeds {n['factor']:.0f}x the noise floor (largest {n['max_ratio_below']:.2g}x)"))
    console.print_table(rows, title=f"bisect {report.run_a} vs {report.run_b}")
    if c.diffs and report.found_before_trace:
        # The trace's first difference is a later step than the divergence: never shown as its fields.
        s = report.first_step
        there = ("every field its records hold is equal there" if c.compared[0] <= s < c.compared[1]
                 else "the traces do not record that step")
        console.status(f"the traces first record a difference at step {c.first_step} ({c.first.kind} "
                       f"{c.first.name}), after the divergent step {s}: {there}")
    elif c.diffs:
        console.print_table(
            [(d.kind, shown(d.name), _num(d.a), _num(d.b),
              "" if not d.distance or d.distance.get("nan") else f"abs {d.distance['abs']:.3g} ulp {d.distance['ulp']}")
             for d in c.diffs[:15]],
            columns=("kind", "field", "A", "B", "distance"),
            title=f"recorded fields that differ at step {c.first_step}, causal order",
        )
    if r.get("compared"):
        _render_refinement(r, shown)
    for note in report.notes + r.get("notes", []):
        console.status(note)


def _render_partial(report) -> None:
    """No difference found, but not over the whole runs: say exactly what was compared."""
    c = report.comparison
    said = []
    if c.compared[1] > c.compared[0]:
        said.append(f"steps {c.compared[0]}..{c.compared[1] - 1} of A are identical to B")
    else:
        said.append("the traces hold no step in common")
    for name, line in report.damage.items():
        said.append(f"{name}'s trace is damaged ({line}), so only the steps both traces can read were compared")
    if report.method == "checkpoint comparison" and report.failure is None:
        said.append("; ".join(report.notes) or "the states at the common checkpoints are equal")
    if report.failure is not None:
        said.append("the replay that would check the states the traces do not show failed (the error below), so "
                    "these runs are not known to be identical")
    console.print_text("; ".join(said), style="yellow")
    if report.failure is None and report.method != "checkpoint comparison":
        for note in report.notes:
            console.status(note)


def _render_refinement(r: dict, shown: Callable[[str], str] = str) -> None:
    d = r.get("distances") or {}
    rows = [("layer", shown(str(r.get("layer")))), ("first that differs", shown(str(r.get("first_intermediate"))))]
    if d:
        rows += [("max abs", _num(d.get("max_abs"))), ("max relative", _num(d.get("max_rel"))),
                 ("max ULP", _num(d.get("max_ulp"))),
                 ("elements that differ", f"{r.get('differing')} of {r.get('elements')} "
                                          f"({100 * r.get('share_differing', 0):.4g}%)")]
        if r.get("at") is not None:
            rows.append(("largest at", f"{r['at']}: A {_num(r.get('a_value'))}, B {_num(r.get('b_value'))}"))
        if r.get("dtype_a") != r.get("dtype_b"):
            rows.append(("dtype", f"A {r.get('dtype_a')}, B {r.get('dtype_b')}"))
    progs = r.get("programs") or {}
    if progs.get("A") != progs.get("B"):
        rows.append(("programs", f"A {progs.get('A')}, B {progs.get('B')}"))
    console.print_table(rows, title=f"inside the layer: step {r.get('step')} recomputed in both runs")
    compared = r["compared"]
    cut = next((i for i, x in enumerate(compared) if not x["equal"]), len(compared))
    lo, hi = max(0, cut - 3), min(len(compared), cut + 4)
    table = [(f"({lo} before: all equal)", "", "", "")] if lo else []
    table += [(shown(x["name"]), "equal" if x["equal"] else "differs",
               "" if x["equal"] else f"{100 * x['share_differing']:.4g}%", "" if x["equal"] else _num(x.get("max_ulp")))
              for x in compared[lo:hi]]
    rest = compared[hi:]
    if rest:
        table.append((f"({len(rest)} after: {sum(not x['equal'] for x in rest)} differ)", "", "", ""))
    console.print_table(table, columns=("compared, in order", "", "elements differing", "max ULP"))


def register(app: typer.Typer) -> None:
    app.command("bisect")(bisect)
