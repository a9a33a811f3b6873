"""Plots of `replay spike`: the scanned loss curve, and one analysed step with its layer heat map."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from replay.spike.analysis import SpikeReport
from replay.spike.detect import Scan, _loss_curve, rolling_scores, shown
from traces import Run


def plot_spike(run: Run, report: SpikeReport, out: str | Path, after: int | None = None) -> Path:
    """Loss and gradient norm around the step (baseline and threshold marked) and the per-layer
    RMS heat map (log2 of RMS over its window median) for the window, the step and the steps after it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schema, trace = run.schema, run.trace
    step = report.step
    lo = report.window[0]
    hi = min(trace.end - 1, step + (after if after is not None else max(5, (step - lo) // 2)))
    recs = list(trace.records(lo, hi + 1))
    xs = np.array([r.step for r in recs])
    fig, axes = plt.subplots(3, 1, figsize=(10, 11), gridspec_kw={"height_ratios": [2, 2, 5]})
    for ax, name, spike in ((axes[0], "loss", report.loss), (axes[1], "grad_norm", report.grad_norm)):
        if name not in schema.metric_names:
            ax.set_visible(False)
            continue
        i = schema.metric_index(name)
        ax.plot(xs, [r.metrics[i] for r in recs], lw=1.2, marker=".", ms=3)
        if spike is not None and math.isfinite(spike.baseline):
            ax.axhline(spike.baseline, color="grey", lw=0.8, ls=":", label="window median")
            if name == "loss":
                ax.axhline(spike.baseline + report.threshold * spike.spread, color="tab:orange", lw=0.8, ls="--",
                           label=f"threshold ({report.threshold:g} spreads)")
        ax.axvline(step, color="tab:red", lw=1, ls="--")
        ax.axvspan(report.window[0] - 0.5, report.window[1] + 0.5, color="grey", alpha=0.08)
        ax.set_ylabel(name)
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_title(f"{Path(shown(run)).name}: step {step} (score {report.loss.score:.1f}); shaded: baseline window")
    heat_ax = axes[2]
    if report.layers:
        names = [r.name for r in report.layers]
        cols = [index for index, n in enumerate(schema.tensor_names) if n in set(names)]
        base = np.array([r.baseline for r in report.layers])
        grid = np.full((len(names), len(recs)), np.nan)  # steps without layer RMS stay blank
        for k, r in enumerate(recs):
            rms = r.rms if r.rms is not None else report.replayed_rms.get(r.step)
            if rms is not None:
                with np.errstate(all="ignore"):
                    grid[:, k] = np.log2(np.maximum(np.asarray(rms, np.float64)[cols], 1e-30) / base)
        finite = grid[np.isfinite(grid)]
        lim = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
        cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#dddddd")
        img = heat_ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=-lim, vmax=lim,
                             interpolation="nearest", extent=(xs[0] - 0.5, xs[-1] + 0.5, len(names) - 0.5, -0.5))
        heat_ax.set_yticks(range(len(names)))
        heat_ax.set_yticklabels(names, fontsize=max(3, min(8, 400 // max(1, len(names)))))
        heat_ax.axvline(step, color="black", lw=0.6, ls=":", alpha=0.5)
        fig.colorbar(img, ax=heat_ax, label="log2(RMS / window median)")
        heat_ax.set_xlabel("step")
        heat_ax.set_title("per-layer RMS: forward outputs (execution order), then gradients (backprop order)")
    else:
        heat_ax.text(0.5, 0.5, "no layer RMS recorded around this step", ha="center", va="center")
        heat_ax.set_axis_off()
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_scan(run: Run, result: Scan, out: str | Path) -> Path:
    """The whole loss curve with the rolling baseline, the threshold and the spikes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, loss = _loss_curve(run)
    base, spread, _ = rolling_scores(loss, result.window)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(steps, loss, lw=1.0, label="loss")
    ax.plot(steps, base, lw=0.8, color="grey", ls=":", label=f"median of previous {result.window}")
    ax.plot(steps, base + result.threshold * spread, lw=0.8, color="tab:orange", ls="--", label="threshold")
    for s in result.spikes:
        ax.plot([s.step], [s.loss], "o", color="tab:red", ms=5)
        ax.annotate(str(s.step), (s.step, s.loss), xytext=(4, 4), textcoords="offset points", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{Path(shown(run)).name}: {len(result.spikes)} spike(s) at threshold {result.threshold:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
