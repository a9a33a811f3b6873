"""Plots people can open: both runs' loss curves, their difference, the divergence marked."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from traces import Run


def metric_curve(run: Run, name: str = "loss") -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a recorded scalar metric over the readable trace."""
    from traces.columns import metric

    steps = np.arange(run.trace.start, run.trace.end)
    return steps, metric(run.trace, name).astype(np.float64)  # one column, segment by segment


def plot_divergence(run_a: Run, run_b: Run, first_step: int | None, out: str | Path, metric: str = "loss",
                    label_a: str = "A", label_b: str = "B") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sa, va = metric_curve(run_a, metric)
    sb, vb = metric_curve(run_b, metric)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    top.plot(sa, va, label=f"{label_a}: {run_a.path.name}", lw=1.2)
    top.plot(sb, vb, label=f"{label_b}: {run_b.path.name}", lw=1.2, alpha=0.85)
    top.set_ylabel(metric)
    top.set_title(f"{metric}: {run_a.path.name} vs {run_b.path.name}")
    lo, hi = max(sa[0] if len(sa) else 0, sb[0] if len(sb) else 0), min(sa[-1] + 1 if len(sa) else 0, sb[-1] + 1 if len(sb) else 0)
    common = np.arange(lo, hi)
    diff = vb[common - sb[0]] - va[common - sa[0]] if len(common) else np.array([])
    bottom.plot(common, diff, color="tab:red", lw=1.0)
    bottom.axhline(0, color="grey", lw=0.6)
    bottom.set_ylabel(f"{label_b} - {label_a}")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        if first_step is not None:
            ax.axvline(first_step, color="black", ls="--", lw=1)
    if first_step is not None:
        top.annotate(f"first divergence: step {first_step}", xy=(first_step, top.get_ylim()[1]),
                     xytext=(5, -15), textcoords="offset points", fontsize=9)
    top.legend(loc="upper right", fontsize=9)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_layer_distances(report, out: str | Path) -> Path:
    """Heat map of every compared field's distance / noise floor (log10) over the examined steps
    of a cross-framework bisect (replay/bisect/cross.py), the first step above the floor marked.
    Fields in causal order, top to bottom; cost O(steps examined x fields)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    steps = sorted(report.distances)
    names = [(n, k) for n, k in report.names if any(n in report.distances[s] for s in steps)]
    grid = np.full((len(names), len(steps)), np.nan)
    for j, s in enumerate(steps):
        for i, (n, k) in enumerate(names):
            d = report.distances[s].get(n)
            if d is not None:
                grid[i, j] = np.log10(max(d, 1e-12) / report.noise.at(k, s))
    fig, ax = plt.subplots(figsize=(min(16, 4 + 0.08 * len(steps)), min(20, 2 + 0.16 * len(names))))
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="RdBu_r", vmin=-4, vmax=4,
                   extent=(-0.5, len(steps) - 0.5, len(names) - 0.5, -0.5))
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([n for n, _ in names], fontsize=6)
    ticks = np.linspace(0, len(steps) - 1, min(len(steps), 10)).round().astype(int) if steps else []
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(steps[t]) for t in ticks])
    ax.set_xlabel("step (examined)")
    fig.colorbar(im, ax=ax, label="log10(distance / noise floor): > 0 is above")
    title = f"{report.run_a} vs {report.run_b}: "
    if report.first_step is not None and report.first_step in steps:
        col = steps.index(report.first_step)
        ax.axvline(col, color="black", ls="--", lw=1)
        row = [n for n, _ in names].index(report.first_layer) if report.first_layer in [n for n, _ in names] else None
        if row is not None:
            ax.plot([col], [row], marker="o", mfc="none", mec="black", ms=10)
        title += f"first above the floor: step {report.first_step}, {report.cause_text}"
    else:
        title += "within the noise floor at every examined step"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
