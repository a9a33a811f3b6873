"""`replay spike RUN`: list loss spikes; `--step S`: replay S bit-exactly and show what drives it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from replay.cli import console
from replay.errors import EXIT_DIVERGED
from replay.spike import (DEFAULT_METRIC, DEFAULT_THRESHOLD, DEFAULT_TOP, DEFAULT_WINDOW, analyze, check_metric,
                          check_step, check_window, plot_scan, plot_spike, scan)
from replay.bundle import open_run
from replay.engine.damage import bundle_terms, damage_error, named_as_bundle
from replay.spike import save_batch as write_batch
from replay.spike.analysis import check_save_batch


def spike(
    path: Annotated[Path, typer.Argument(help="The run directory (or a bundle from `replay pack`).")],
    step: Annotated[Optional[int], typer.Option("--step", help="Replay this step from the nearest checkpoint and "
                                                "show which examples and layers drive its loss.")] = None,
    window: Annotated[int, typer.Option("--window", help="Steps before each step that form its baseline.")] = DEFAULT_WINDOW,
    threshold: Annotated[float, typer.Option("--threshold", help="A spike scores at least this many robust spreads "
                                             "(1.4826 x MAD) above the window's median loss.")] = DEFAULT_THRESHOLD,
    top: Annotated[int, typer.Option("--top", help="--step: how many examples to list.")] = DEFAULT_TOP,
    save_batch: Annotated[Optional[Path], typer.Option("--save-batch", help="--step: write the batch fed at the step "
                                                       "(int32 [batch, seq_len + 1] tokens) to this .npy file.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG: with --step, loss and grad norm around "
                                                 "it and the per-layer RMS heat map; without, the loss curve.")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Where the run's token file is now.")] = None,
    allow_data_change: Annotated[bool, typer.Option("--allow-data-change",
                                                    help="Replay although the data fingerprint changed.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    metric: Annotated[str, typer.Option("--metric", help="The recorded metric to look for spikes in.")] = DEFAULT_METRIC,
    allow_code: Annotated[bool, typer.Option("--allow-code", help="Run the training-loop code the run's manifest "
                                             "names from a folder it names (never from inside a bundle).")] = False,
) -> None:
    """Find loss spikes in a run, or replay one (--step) and show its examples and layers."""
    check_window(window, threshold)
    if top < 1:
        console.fail(f"--top {top} must be at least 1")
    for opt, value in (("--save-batch", save_batch), ("--plot", plot)):
        console.local_output(opt, value)
        if value is not None and not value.parent.is_dir():
            console.fail(f"{opt} {value}: the folder {value.parent} does not exist")
    if save_batch is not None and save_batch.suffix != ".npy":
        console.fail(f"--save-batch {save_batch}: the file name must end in .npy")
    target = open_run(path, for_replay=step is not None)  # a run folder, or a bundle unpacked to a temporary folder
    with named_as_bundle(target):  # messages name BUNDLE or BUNDLE:member, not the temporary folder
        _spike(target, path, step, window, threshold, top, save_batch, plot, data, allow_data_change, json_out,
               metric, allow_code)


def _spike(target, path: Path, step: int | None, window: int, threshold: float, top: int, save_batch: Path | None,
           plot: Path | None, data: str | None, allow_data_change: bool, json_out: bool, metric: str,
           allow_code: bool) -> None:
    check_metric(target, metric)  # before anything is replayed: names the metrics the run has
    if step is None:
        # A scan of a damaged trace would find spikes in what is left and exit 0 (--step refuses it in
        # load_replayable); a crashed run's torn last record is not damage: what was recorded is scanned.
        damaged = damage_error(target, f"{path}: its trace", "restore the run's files from a copy")
        if damaged:
            raise damaged
        if save_batch is not None:
            console.fail("--save-batch needs --step S: it writes the batch of step S")
        result = scan(target, window, threshold, metric)
        if plot is not None:
            plot_scan(target, result, plot)
        if json_out:
            console.print_json(result.to_json())
        else:
            _render_scan(result)
            if plot is not None:
                console.print_text(f"plot written to {plot}")
        return
    _spike_step(target, path, step, window, threshold, top, save_batch, plot, data, allow_data_change, json_out,
                metric, allow_code)


def _spike_step(target, path: Path, step: int, window: int, threshold: float, top: int, save_batch: Path | None,
                plot: Path | None, data: str | None, allow_data_change: bool, json_out: bool,
                metric: str = DEFAULT_METRIC, allow_code: bool = False) -> None:
    from replay.cli.replaying import load_replayable, prepare_process, replay_notes, replay_progress

    prepare_process(target)
    rep, contract = load_replayable(target, path, data, allow_data_change,
                                    lambda checkpoints: check_step(target, step, window, checkpoints),
                                    allow_code=allow_code)
    if save_batch is not None:  # before the replay: a loop without token rows is told at once

        check_save_batch(rep, target)
    with replay_progress(f"replay {path.name} to step {step}", step) as on_step:
        report = analyze(target, rep, step, contract, window, threshold, top, on_step, metric=metric)
    report.notes.extend(replay_notes(rep))
    report.notes = [_bundle_terms(target, n) for n in report.notes]  # restore notes name checkpoint folders
    check = _sdc_check_at(target, step)
    if check is not None:  # a silent-data-corruption re-run disagreed at this step: a chip, not the batch
        report.notes.append(check)
    if save_batch is not None:
        write_batch(rep, target, step, save_batch)
        report.notes.append(f"batch of step {step} written to {save_batch} (int32 [batch, seq_len + 1]; "
                            "its rows hash to the recorded example hashes)")
    if plot is not None:
        plot_spike(target, report, plot)
        report.notes.append(f"plot written to {plot}")
    if json_out:
        console.print_json(report.to_json())
    else:
        _render_step(report)
    if not report.exact and report.replay.contract.expect_bits:
        raise typer.Exit(EXIT_DIVERGED)


def _bundle_terms(target, text: str) -> str:
    return bundle_terms(target, text)


def _f(x: float | None, digits: int = 4) -> str:
    if x is None:
        return ""
    return f"{x:.{digits}g}" if math.isfinite(x) else str(x)


def _render_scan(result) -> None:
    title = (f"spikes in {result.run} (steps {result.scanned[0]}..{result.scanned[1]} against the previous "
             f"{result.window}; threshold {result.threshold:g})")
    best = result.max_score
    if not result.spikes:
        console.print_text(f"no spikes in {result.run}: steps {result.scanned[0]}..{result.scanned[1]} scanned against "
                           f"the median and MAD of the previous {result.window} steps", style="green")
        if best is not None:
            console.print_text(f"highest score {_f(best.score, 3)} at step {best.step} (threshold {result.threshold:g})")
        return
    console.print_table(
        [(s.step, _f(s.loss), _f(s.baseline), _f(s.spread, 3), _f(s.score, 3), f"{s.rise:+.1%}" if math.isfinite(s.rise) else "")
         for s in result.spikes],
        columns=("step", "loss", "baseline (median)", "spread", "score", "rise"), title=title,
        justify=("right",) * 6,
    )
    console.print_text(f"{len(result.spikes)} spike(s); replay one with: replay spike {result.run} --step "
                       f"{max(result.spikes, key=lambda s: s.score).step}")


def _sdc_check_at(run, step: int) -> str | None:
    """The in-training re-run check's verdict at `step` (trainer/sdc.py), when it ran there and
    disagreed; one record read."""
    from replay.verify import checks

    if not checks.check_tensors(run.schema):
        return None
    found = checks.describe(run.manifest, run.schema, run.trace.read(step))
    return found["line"] if found is not None and found["microbatches"] else None


def _render_step(report) -> None:
    r = report.replay
    j = r.to_json()
    exact_word = "bit-exact" if r.contract.expect_bits else "bit-identical (not promised here)"
    loss, grad = report.loss, report.grad_norm
    rows = [
        ("step", str(report.step)),
        ("loss", f"{_f(loss.loss)}  baseline {_f(loss.baseline)} (median of steps {report.window[0]}..{report.window[1]})"
                 f"  score {_f(loss.score, 3)}  rise {loss.rise:+.1%}"),
    ]
    if grad is not None:
        rows.append(("grad norm", f"{_f(grad.loss)}  baseline {_f(grad.baseline)}  x{_f(grad.loss / grad.baseline, 3)}"
                                  f"  score {_f(grad.score, 3)}"))
    rows.append(("typical example loss", f"{_f(report.typical_example_loss)} (spread {_f(report.example_spread, 3)})"))
    first = report.first_jump
    if report.layers:
        rows.append(("first layer to jump", f"{first.name} ({first.kind}) x{_f(first.ratio, 3)}, score {_f(first.score, 3)}"
                     if first else f"none above {report.threshold:g} spreads"))
    rows += [
        ("replayed", f"steps {r.checkpoint}..{report.step} from checkpoint {r.checkpoint}"),
        (exact_word, f"{len(r.steps) - len(j['mismatched_steps'])} of {len(r.steps)} steps"),
        ("contract", r.contract.line),
    ]
    if report.injected:
        rows.append(("injected fault", f"bad-batch@{report.step} replaced positions {', '.join(map(str, report.injected))}"))
    console.print_table(rows, title=f"spike at step {report.step} of {report.run}")
    if report.examples:
        console.print_table(
            [(e.position, _f(e.loss), _f(e.score, 3), f"{e.share:.0%}" if math.isfinite(e.share) and abs(e.share) >= 0.005 else ("0%" if math.isfinite(e.share) else ""),
              f"{e.hash:016x}",
              (f"step {e.seen_before}" if e.seen_before is not None else "no")
              + (f"; same as {', '.join(map(str, e.duplicates))}" if e.duplicates else ""),
              _clip(e.text if e.text is not None else (" ".join(map(str, e.tokens)) if e.tokens else "")))
             for e in report.examples],
            columns=("position", "loss", "score", "share of rise", "hash", "seen before", "first tokens"),
            title=f"examples with the largest loss (typical {_f(report.typical_example_loss)} over the window)",
        )
    jumped = [l for l in report.layers if l.jumped]
    if jumped:
        console.print_table(
            [(l.kind, l.name, _f(l.rms), _f(l.baseline), f"x{_f(l.ratio, 3)}", _f(l.score, 3)) for l in jumped[:15]],
            columns=("kind", "layer", "RMS", "baseline", "ratio", "score"),
            title=f"layers whose RMS jumped ({report.layer_source}), causal order: forward, then backprop",
        )
        if len(jumped) > 15:
            console.print_text(f"... and {len(jumped) - 15} more (see --json)")
    for note in report.notes:
        console.print_text(f"note: {note}")
    if not report.exact:
        first_bad = r.first_mismatch
        verdict = ("the contract promised bits here: this is a real divergence" if r.contract.expect_bits
                   else "the contract does not promise bits on this machine; the recorded values are reported")
        console.print_text(f"the replay differs from the trace from step {first_bad.step} "
                           f"({', '.join(d.name for d in first_bad.diffs[:4])}); {verdict}",
                           style="red" if r.contract.expect_bits else "yellow")
    else:
        console.print_text(f"all {len(r.steps)} replayed steps are bit-identical to the trace", style="green")


def _clip(text: str, width: int = 32) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def register(app: typer.Typer) -> None:
    app.command("spike")(spike)
