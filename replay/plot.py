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
