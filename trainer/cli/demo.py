"""`replay demo`: the main job of the README quick start (see trainer/demo.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Optional

import typer

from replay.cli import console
from trainer.demo_reference import DEFAULT_BUG, DEFAULT_STEPS, RUNS, run_reference_demo
from trainer.port_bugs import PORT_BUGS


def demo(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the two runs and the plot.")] = Path("replay-demo"),
    steps: Annotated[Optional[int], typer.Option("--steps", help="Steps per run; the fault starts half way "
                                                 "(default 160; with --reference torch 40).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an earlier demo in --out.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    reference: Annotated[Optional[str], typer.Option("--reference", help="torch: check the JAX trainer against its "
                                                     "PyTorch reference (HF OLMo), then find a port bug.")] = None,
    bug: Annotated[Optional[str], typer.Option("--bug", help="With --reference torch: the port bug to plant in the "
                                                "JAX side (rope, norm_eps, qk_norm, adam_eps, z_loss; default rope).")] = None,
) -> None:
    """Train two runs, one fed repeated data from the middle on, and let bisect and audit find it.
    With --reference torch: a JAX port against its PyTorch reference, clean and with a port bug."""
    if reference is not None:
        return _reference_demo(out, steps, force, json_out, reference, bug)
    if bug is not None:
        console.fail(f"--bug {bug}: a port bug is planted only in the reference demo; add --reference torch")
    from trainer.demo import DEFAULT_STEPS, run_demo

    steps = DEFAULT_STEPS if steps is None else steps
    if steps < 16:
        console.fail(f"--steps {steps}: the demo needs at least 16 steps (the fault starts half way)")
    _check_out(out)
    _replace_earlier(out, ("run-A", "run-B"), {"divergence.png"}, force)
    with console.progress("replay demo") as bar:
        task = bar.add_task("demo", total=None, info="")

        def on_phase(name: str, total: int) -> None:
            bar.update(task, description=name, total=total or 1, completed=0, info="")

        def on_step(info) -> None:
            loss = f"loss {info.loss:.3f}" if info.loss is not None else ""
            bar.update(task, completed=info.step + 1, info=f"{loss}  {info.tokens_per_s:,.0f} tok/s")

        result = run_demo(out, steps, on_phase, on_step)
        bar.update(task, completed=bar.tasks[task].total)
    if json_out:
        console.print_json(result.to_json())
        return
    j = result.to_json()
    rows = [
        ("run A (clean)", str(result.run_a)),
        ("run B (resumed on 2 processes)", f"{result.run_b}  (data.sampler=contiguous-per-host, resumed at step "
                                           f"{result.fault_step} on twice the processes)"),
        ("first divergent step", str(j["first_step"])),
        ("cause", str(j["cause"])),
        ("examples that differ", f"{j['examples_differing']} of the {result.batch_size} in the batch"),
        ("already seen by B", f"{j['already_seen_in_b']} of them, first fed by B at step(s) "
                              f"{', '.join(map(str, j['first_seen_steps'][:8]))}"),
        ("audit of A", "ok: every example once per epoch" if result.audit_a_ok else "FLAGGED"),
        ("audit of B", result.audit_b_summary),
        (f"mean loss from step {result.fault_step}", f"A {result.loss_a_after:.4f}   B {result.loss_b_after:.4f}"
                                                     + (f"   (B on examples it had seen {result.loss_b_seen:.4f}, on new "
                                                        f"ones {result.loss_b_new:.4f})"
                                                        if result.loss_b_seen is not None and result.loss_b_new is not None
                                                        else "")),
        ("plot", str(result.plot)),
        ("time", ", ".join(f"{k} {v} s" for k, v in result.seconds.items())),
    ]
    console.print_table(rows, title="replay demo: a data-loader bug that re-feeds seen data after a change of host count")
    console.print_text(f"next: replay bisect {result.run_a} {result.run_b}   |   replay audit {result.run_b}   |   "
                       f"replay run {result.run_b} --steps {result.fault_step}:{result.fault_step + 4}")


def _reference_demo(out: Path, steps: int | None, force: bool, json_out: bool, reference: str,
                    bug: str | None) -> None:
    if reference != "torch":
        console.fail(f"--reference {reference}: the only reference there is is torch (HF transformers' OLMo)")
    bug = DEFAULT_BUG if bug is None else bug
    if bug not in PORT_BUGS:
        console.fail(f"--bug {bug}: not a port bug; choose one of {', '.join(PORT_BUGS)}")
    steps = DEFAULT_STEPS if steps is None else steps
    if steps < 8:
        console.fail(f"--steps {steps}: the reference demo needs at least 8 steps")
    _check_out(out)
    _replace_earlier(out, tuple(RUNS), set(), force)
    with console.progress("replay demo --reference torch") as bar:
        task = bar.add_task("demo", total=None, info="")

        def on_phase(name: str, total: int) -> None:
            bar.update(task, description=name, total=total or 1, completed=0, info="")

        def on_step(info) -> None:
            bar.update(task, completed=info.step + 1, info=f"loss {info.loss:.3f}" if info.loss is not None else "")

        result = run_reference_demo(out, steps, bug, on_phase, on_step)
    if json_out:
        console.print_json(result.to_json())
        return
    c, b = result.clean, result.buggy_report
    clean_line = (f"agree within the noise floor at all {len(c.distances)} steps (largest distance "
                  f"{c.max_ratio:.2g} x the floor)" if c.within_noise else
                  f"NOT within the noise floor: step {c.first_step}, {c.cause_text}")
    rows = [("reference (PyTorch, HF OLMo)", str(result.reference)), ("JAX trainer, same weights and data",
                                                                       str(result.port)),
            ("inputs", "data and initial parameters equal bit for bit"
             if all((v or {}).get("equal") for v in c.inputs.values()) else str(c.inputs)),
            ("reference vs JAX", clean_line)]
    if result.eval is not None:
        e = result.eval
        rows.append(("compare --eval", ("agree" if e.agree else "DIFFER") + " at steps " + ", ".join(
            f"{r.step} (|B-A| {abs(r.difference):.2g} <= {r.tolerance:.2g})" if r.agree else
            f"{r.step} (|B-A| {abs(r.difference):.2g} > {r.tolerance:.2g})" for r in e.rows)))
    rows += [(f"JAX port with bug {result.bug}", f"{result.buggy}  ({result.bug_text})"),
             ("first step off the reference", str(b.first_step)), ("first layer", str(b.first_layer)),
             ("cause", str(b.cause_text)),
             ("expected", f"{result.expected['first_tensor']} ({result.expected['kind']}): "
                          + ("found" if result.found_as_expected else "NOT what was found")),
             ("time", ", ".join(f"{k} {v} s" for k, v in result.seconds.items()))]
    console.print_table(rows, title="replay demo --reference torch: a JAX port against its PyTorch reference")
    console.print_text(f"next: replay bisect {result.reference} {result.buggy} --plot heatmap.png   |   "
                       f"replay compare {result.reference} {result.port} --eval")


def _replace_earlier(out: Path, runs: tuple[str, ...], files: set[str], force: bool) -> None:
    """A non-empty --out is refused unless it holds only an earlier demo's `runs` and `files` and
    --force is given; then those run folders are removed (the files are overwritten)."""
    if not (out.exists() and any(out.iterdir())):
        return
    earlier = {p.name for p in out.iterdir()} <= set(runs) | files
    if not (force and earlier):
        console.fail(f"{out} is not empty; choose another --out" + (", or pass --force to replace the earlier demo"
                                                                    if earlier else ""))
    for name in runs:
        shutil.rmtree(out / name, ignore_errors=True)


def _check_out(out: Path) -> None:
    """--out must be a folder, or a path one can be made at: refused before minutes of training."""
    if out.exists() and not out.is_dir():
        console.fail(f"--out {out} is a file, not a folder; give a folder for the two runs (it is made if missing)")
    parent = next(p for p in (out, *out.parents) if p.exists())
    if not parent.is_dir():
        console.fail(f"--out {out}: {parent} is a file, so no folder can be made there; give another --out")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
