"""The demo: the data-loader bug that feeds already-seen data after a cluster change, found in one command.

Both runs are one `demo` run on the embedded corpus with `data.sampler=contiguous-per-host`, the
loader of trainer/order.py: each host reads its own contiguous slice of the epoch's shuffle and,
on resume, jumps to step x (global batch / host count) in it, as the MaxText OLMo loader did.
It trains to the middle step S on one process; a copy of it is run A, resumed at S on one
process (the same cluster); run B is resumed at S on 2 processes (a new cluster: `replay train
--resume` under jax.distributed, 127.0.0.1, one CPU device each). Host 0 of the two jumps to
position S x B/2 of its slice, which the one host fed at steps S/2..S: from S on, half of every
batch of B is data it has already seen. Nothing is injected. Then `bisect` names step S, the
cause `data` and the share already seen, `audit` flags B from its own trace alone (and passes
A), and the plot shows both loss curves from the shared start.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from replay.audit import audit
from replay.bisect import BisectReport, bisect
from replay.plot import metric_curve, plot_divergence
from traces import Run, TraceError
from trainer.config import apply_overrides
from trainer.presets import get_preset
from trainer.loop import StepInfo, load_resume_config, train

DEFAULT_STEPS = 160
SAMPLER = "contiguous-per-host"
PROCESSES = 2  # B's new cluster
_POLL_S = 0.5


@dataclass
class DemoResult:
    run_a: Path
    run_b: Path
    plot: Path
    fault_step: int  # the step B was resumed at on PROCESSES processes: where the bug starts
    bisect: BisectReport
    audit_a_ok: bool
    audit_b_ok: bool
    audit_b_first: int | None
    audit_b_summary: str
    loss_a_after: float  # mean training loss of A over steps S..end
    loss_b_after: float
    batch_size: int
    audit_b_share: list[float] = field(default_factory=list)  # per step from S: share of B's batch that came back early
    loss_b_seen: float | None = None  # B's mean per-example loss from S on, over the examples it had already fed
    loss_b_new: float | None = None  # ... and over the others
    seconds: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        b = self.bisect
        repeated = b.repeated("B")
        return {
            "run_a": str(self.run_a), "run_b": str(self.run_b), "plot": str(self.plot),
            "sampler": SAMPLER, "resume_step": self.fault_step, "processes": [1, PROCESSES],
            "first_step": b.comparison.first_step, "cause": b.cause,
            "examples_differing": len(b.comparison.first.positions or []) if b.comparison.first else 0,
            "already_seen_in_b": len(repeated), "share_already_seen": len(repeated) / self.batch_size,
            "first_seen_steps": sorted({s["step"] for e in repeated for s in e.seen if s["run"] == "B"}),
            "audit_a_ok": self.audit_a_ok, "audit_b_ok": self.audit_b_ok, "audit_b_first_repeat": self.audit_b_first,
            "audit_b_share_per_step": sorted(set(self.audit_b_share)),
            "loss_a_after": self.loss_a_after, "loss_b_after": self.loss_b_after,
            "loss_b_seen": self.loss_b_seen, "loss_b_new": self.loss_b_new, "seconds": self.seconds,
        }


def run_demo(out: Path, steps: int = DEFAULT_STEPS, on_phase: Callable[[str, int], None] | None = None,
             on_step: Callable[[StepInfo], None] | None = None) -> DemoResult:
    """Trains the run to S and resumes it as A (here) and as B (in PROCESSES fresh processes) under
    `out`, then bisects, audits and plots them."""
    phase = on_phase or (lambda name, total: None)
    out.mkdir(parents=True, exist_ok=True)
    cfg = apply_overrides(get_preset("demo"), [f"steps={steps}", f"checkpoint.every_steps={steps // 4}",
                                               f"optimizer.decay_steps={steps}",
                                               f"optimizer.warmup_steps={min(50, steps // 4)}",
                                               f"data.sampler={SAMPLER}"])
    resume_step = steps // 2
    seconds = {}
    t0 = time.perf_counter()
    phase(f"training to step {resume_step} (1 process)", resume_step)
    # Configured for S steps, then resumed to `steps`: checkpoint S is the run's last, and both
    # A and B continue from it. A is a copy of the run directory, as it stood at S.
    train(apply_overrides(cfg, [f"steps={resume_step}"]), out / "run-B", preset="demo", on_step=on_step)
    shutil.copytree(out / "run-B", out / "run-A", ignore=shutil.ignore_patterns(".lock"))
    seconds["train_to_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    phase(f"resuming run A at step {resume_step} on 1 process", steps)
    train(load_resume_config(out / "run-A", None, steps), out / "run-A", resume=True, on_step=on_step)
    seconds["resume_a"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    phase(f"resuming run B at step {resume_step} on {PROCESSES} processes", steps)
    resume_on_processes(out / "run-B", steps, PROCESSES, cfg.data.global_batch_size * cfg.model.seq_len, on_step)
    seconds["resume_b"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    phase("bisect, audit and plot", 0)
    run_a, run_b = Run.open(out / "run-A"), Run.open(out / "run-B")
    report = bisect(run_a, run_b)
    audit_a, audit_b = audit(run_a), audit(run_b)
    plot = plot_divergence(run_a, run_b, report.comparison.first_step, out / "divergence.png",
                           label_a="A (1 host)", label_b=f"B ({PROCESSES} hosts)")
    _, loss_a = metric_curve(run_a)
    _, loss_b = metric_curve(run_b)
    B = cfg.data.global_batch_size
    early_b = audit_b.early_slots // B
    share = [float(np.count_nonzero(early_b == k)) / B for k in range(resume_step, steps)]
    seen, new = _split_losses(run_b, audit_b.early_slots, resume_step, B)
    seconds["analyse"] = time.perf_counter() - t0
    return DemoResult(out / "run-A", out / "run-B", plot, resume_step, report, audit_a.ok, audit_b.ok,
                      audit_b.first_early_repeat_step, audit_b.summary(), float(np.mean(loss_a[resume_step:])),
                      float(np.mean(loss_b[resume_step:])), B, share, seen, new,
                      {k: round(v, 1) for k, v in seconds.items()})


def _split_losses(run: Run, early_slots: np.ndarray, start: int, batch: int) -> tuple[float | None, float | None]:
    """Mean per-example loss from `start` on over the slots audit flagged (data fed before) and the rest."""
    if "loss" not in run.schema.example_metrics:
        return None, None
    row = run.schema.example_metrics.index("loss")
    losses = np.stack([run.trace.read(k).example_metrics[row] for k in range(start, run.trace.end)]).astype(np.float64)
    flagged = np.zeros(losses.shape, bool)
    slots = early_slots[early_slots >= start * batch] - start * batch
    flagged.reshape(-1)[slots] = True
    mean = lambda x: float(x.mean()) if x.size else None  # noqa: E731
    return mean(losses[flagged]), mean(losses[~flagged])


# ------------------------------------------------------------------------------ B's new cluster


def resume_on_processes(run: Path, steps: int, processes: int, tokens_per_step: int,
                        on_step: Callable[[StepInfo], None] | None = None) -> None:
    """`replay train --resume RUN --steps STEPS` on `processes` local processes (jax.distributed
    on 127.0.0.1, one CPU device each), reporting progress from the trace while they train.
    RuntimeError naming the process and its last error line if one fails."""
    port, start, t0 = _free_port(), None, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="replay-demo-") as logs:
        procs, errs = [], []
        for i in range(processes):
            errs.append(open(Path(logs) / f"{i}.err", "w+"))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "replay.cli.app", "train", "--resume", str(run), "--steps", str(steps),
                 "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(i)],
                env=_child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errs[-1]))
        try:
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                start = _progress(run, steps, start, t0, tokens_per_step, on_step)
                time.sleep(_POLL_S)
        finally:
            for p in procs:  # one process failed: the others would wait for it in a collective
                if p.poll() is None:
                    p.kill()
                p.wait()
        for i, (p, err) in enumerate(zip(procs, errs)):
            err.seek(0)
            lines = [ln for ln in err.read().splitlines() if ln.strip()]
            err.close()
            if p.returncode:
                last = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "")
                raise RuntimeError(f"resuming {run} on {processes} processes failed in process {i} "
                                   f"(exit {p.returncode}): {last[:300]}")
    _progress(run, steps, start, t0, tokens_per_step, on_step)


def _progress(run: Path, steps: int, start: int | None, t0: float, tokens_per_step: int,
              on_step: Callable[[StepInfo], None] | None) -> int | None:
    """Reads how far the trainers have got (a snapshot of the trace) and reports it; the first
    step seen is where the rate is counted from."""
    if on_step is None:
        return start
    try:
        snapshot = Run.open(run)
        end = snapshot.trace.end
        loss = float(snapshot.trace.read(end - 1).metrics[snapshot.schema.metric_index("loss")]) if end else None
    except (TraceError, OSError, ValueError):  # caught between two writes: the next poll sees it
        return start
    start = end if start is None else start
    elapsed = time.perf_counter() - t0
    on_step(StepInfo(max(end - 1, 0), steps, loss, (end - start) * tokens_per_step / elapsed if elapsed > 0 else 0.0, None))
    return start


def _child_env() -> dict:
    """The environment of B's processes: CPU, exactly one device each, the rest as ours."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=1").strip()
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
