"""Loss spikes: find them in a recorded run, replay one bit-exactly, and show what drives it.

Detection (`scan`) reads only the trace. A step's loss is compared with the steps before it:

    baseline  = median of the finite losses of the previous `window` steps
    spread    = 1.4826 * MAD of those losses (the MAD scaled to a normal's sigma), at least
                REL_FLOOR * |baseline| so a flat loss cannot make any wobble a spike
    score     = (loss - baseline) / spread        a spike when score >= threshold

The median and MAD are robust: a spike inside the window barely moves them, and a falling
loss (early training) only lowers scores. A non-finite loss is always a spike.

Analysis (`analyze`) of one step S replays the steps from the nearest checkpoint at or before S
through S with the replay engine (replay/engine.py: every recorded field of every replayed
step compared bit for bit with the trace, as `replay run` does), then reports for S:

  * examples: each example's loss against the window's typical per-example loss (median
    and spread of every per-example loss recorded in steps S-window..S-1), with its share of
    the step's rise over the baseline, its hash, whether that hash was fed before (and where),
    duplicates inside the batch, and its first tokens decoded (byte tokenizer runs);
  * layers: the RMS of every forward output and gradient at S against its median over the
    window, on a log scale (ratio and robust score); the first one in causal order (forward
    layers in execution order, then gradients in backprop order) whose |score| reaches the
    threshold is where the spike shows first;
  * the gradient norm against its baseline.

Recorded values come from the trace; where the trace holds no layer RMS at S (a run with
trace.layer_every > 1), a trainer run's steps from the window on are replayed at the layer
level, which trains identically and measures every layer.

Measured (demo preset, 300 steps, CPU, defaults window 50 / threshold 6): the clean run's
highest score is 1.44 (step 204; 3.37 with --window 20); with `--inject bad-batch@150` step 150
scores 34.4 (loss 4.23 against a median of 2.10) and is the only spike. `--step 150` replays
steps 100..150 from checkpoint 100, 51 of 51 bit-exact; the four injected positions 3, 7, 11, 15
are the top four examples (loss 10.74 each against a typical 2.09, each 25% of the rise), the
gradient norm is x33.8 its baseline and the first layer to jump is grad/lm_head.kernel (x8.8);
forward RMS moves by less than 5%. tiny (tests/replay/test_spike.py) learns less by step 65:
the spike scores 20.7 at --window 10 but only 1.3 at the default window, whose median lags
tiny's still steeply falling loss.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from traces import Run, StepRecord

if TYPE_CHECKING:  # the engine imports JAX; `replay spike RUN` (detection only) never needs it
    from replay.engine import ReplayReport, StepResult

DEFAULT_WINDOW = 50
DEFAULT_THRESHOLD = 6.0
MIN_WINDOW = 5
MAD_SCALE = 1.4826  # MAD -> sigma of a normal distribution
REL_FLOOR = 1e-3  # the loss spread never counts as less than 0.1% of the baseline
LOG_FLOOR = 0.01  # a layer's RMS spread never counts as less than 1% (on the log scale)
DEFAULT_TOP = 8
DECODE_TOKENS = 48


class SpikeInputError(ValueError):
    """A step, window or run that spike analysis cannot use; one line, exit 2."""


# ------------------------------------------------------------------------------- robust statistics

def robust(values: np.ndarray, floor: float = 0.0) -> tuple[float, float]:
    """(median, spread) of the finite values; spread = 1.4826 * MAD, at least `floor`."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan
    med = float(np.median(v))
    return med, max(MAD_SCALE * float(np.median(np.abs(v - med))), floor, 1e-12)


def rolling_scores(values_N: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(baseline, spread, score) of each value against the `window` values before it (NaN for
    the first `window`, and where fewer than MIN_WINDOW of them are finite)."""
    v = np.asarray(values_N, np.float64)
    n = v.size
    base, spread, score = (np.full(n, np.nan) for _ in range(3))
    if n <= window:
        return base, spread, score
    finite = np.where(np.isfinite(v), v, np.nan)
    win = np.lib.stride_tricks.sliding_window_view(finite, window)[:-1]  # win[i] = v[i : i+window], before i+window
    enough = np.sum(np.isfinite(win), axis=1) >= MIN_WINDOW
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows: masked out below
        med = np.nanmedian(win, axis=1)
        mad = np.nanmedian(np.abs(win - med[:, None]), axis=1)
    sp = np.maximum(np.maximum(MAD_SCALE * mad, REL_FLOOR * np.abs(med)), 1e-12)
    med[~enough], sp[~enough] = np.nan, np.nan
    base[window:], spread[window:] = med, sp
    with np.errstate(all="ignore"):
        s = (v[window:] - med) / sp
    s[~np.isfinite(v[window:]) & enough] = np.inf  # a NaN or inf loss is always a spike
    score[window:] = s
    return base, spread, score


def _json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by its string (JSON has no NaN or inf)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _num(x: float | None) -> float | str | None:
    """A JSON-safe number: non-finite values become strings ("nan", "inf", "-inf")."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


# ------------------------------------------------------------------------------- detection

@dataclass
class Spike:
    step: int
    loss: float
    baseline: float  # median loss of the previous window
    spread: float  # 1.4826 * MAD of the previous window (floored)
    score: float  # (loss - baseline) / spread

    @property
    def rise(self) -> float:
        return self.loss / self.baseline - 1.0 if self.baseline else math.inf

    def to_json(self) -> dict:
        return {"step": self.step, "loss": _num(self.loss), "baseline": _num(self.baseline),
                "spread": _num(self.spread), "score": _num(self.score), "rise": _num(self.rise)}


@dataclass
class Scan:
    run: str
    window: int
    threshold: float
    scanned: tuple[int, int]  # [first, last] steps with a full baseline window
    spikes: list[Spike] = field(default_factory=list)
    max_score: Spike | None = None  # the highest-scoring step, spike or not: the margin of a clean run

    def to_json(self) -> dict:
        return {"run": self.run, "window": self.window, "threshold": self.threshold,
                "scanned": list(self.scanned), "spikes": [s.to_json() for s in self.spikes],
                "max_score": self.max_score.to_json() if self.max_score else None}


def check_window(window: int, threshold: float) -> None:
    if window < MIN_WINDOW:
        raise SpikeInputError(f"--window {window} is too small for a median and MAD: use at least {MIN_WINDOW}")
    if not threshold > 0:
        raise SpikeInputError(f"--threshold {threshold} must be > 0 (a robust score: spreads above the baseline)")


def _loss_curve(run: Run, name: str = "loss") -> tuple[np.ndarray, np.ndarray]:
    trace = run.trace
    if len(trace) == 0:
        raise SpikeInputError(f"{run.path}: the trace holds no steps (was it recorded with trace.level=off?)")
    index = run.schema.metric_index(name)
    steps = np.arange(trace.start, trace.end)
    return steps, np.array([rec.metrics[index] for rec in trace.records()], np.float64)


def scan(run: Run, window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD) -> Scan:
    """Every recorded step whose loss scores at least `threshold` against the previous window."""
    check_window(window, threshold)
    steps, loss = _loss_curve(run)
    if steps.size <= window:
        raise SpikeInputError(f"{run.path} records {steps.size} steps ({steps[0]}..{steps[-1]}), too few for a baseline "
                              f"of --window {window} previous steps: pass a smaller --window (at least {MIN_WINDOW})")
    base, spread, score = rolling_scores(loss, window)
    result = Scan(str(run.path), window, threshold, (int(steps[window]), int(steps[-1])))
    best = None
    for i in range(window, steps.size):
        if np.isnan(score[i]):
            continue
        spike = Spike(int(steps[i]), float(loss[i]), float(base[i]), float(spread[i]), float(score[i]))
        if best is None or spike.score > best.score:
            best = spike
        if spike.score >= threshold:
            result.spikes.append(spike)
    result.max_score = best
    return result


# ------------------------------------------------------------------------------- analysis of one step

@dataclass
class ExampleRow:
    position: int  # in the global batch
    loss: float
    score: float  # against the window's per-example losses
    share: float  # (loss - typical) / batch size / (step loss - baseline): its part of the rise
    hash: int
    seen_before: int | None  # the first earlier step that fed the same example hash
    duplicates: list[int]  # other positions of this batch holding the same example
    tokens: list[int] | None = None  # its first tokens, where the data source is readable
    text: str | None = None  # those tokens decoded (byte tokenizer)

    def to_json(self) -> dict:
        return {"position": self.position, "loss": _num(self.loss), "score": _num(self.score),
                "share_of_rise": _num(self.share), "hash": f"{self.hash:016x}", "seen_before": self.seen_before,
                "duplicates_in_batch": self.duplicates, "first_tokens": self.tokens, "text": self.text}


@dataclass
class LayerRow:
    name: str
    kind: str  # forward or backward
    rms: float
    baseline: float  # median RMS over the window
    ratio: float  # rms / baseline
    score: float  # log(ratio) / spread of log RMS over the window
    jumped: bool

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "rms": _num(self.rms), "baseline": _num(self.baseline),
                "ratio": _num(self.ratio), "score": _num(self.score), "jumped": self.jumped}


@dataclass
class SpikeReport:
    run: str
    step: int
    window: tuple[int, int]  # [first, last] steps of the baseline window (last = S - 1)
    threshold: float
    loss: Spike
    grad_norm: Spike | None
    typical_example_loss: float
    example_spread: float
    examples: list[ExampleRow]  # the top contributors, largest loss first
    layers: list[LayerRow]  # every forward output and gradient, causal order
    layer_source: str | None  # "recorded", "replayed" or None (no layer RMS at S)
    replay: ReplayReport | None
    injected: list[int] = field(default_factory=list)  # positions a bad-batch fault replaced at S
    notes: list[str] = field(default_factory=list)
    replayed_rms: dict = field(default_factory=dict, repr=False)  # step -> layer RMS from the replay (plots)

    @property
    def first_jump(self) -> LayerRow | None:
        return next((r for r in self.layers if r.jumped), None)

    @property
    def exact(self) -> bool:
        return self.replay is None or self.replay.exact

    def to_json(self) -> dict:
        first = self.first_jump
        return {
            "run": self.run, "step": self.step, "window": list(self.window), "threshold": self.threshold,
            "loss": self.loss.to_json(), "grad_norm": self.grad_norm.to_json() if self.grad_norm else None,
            "typical_example_loss": _num(self.typical_example_loss), "example_spread": _num(self.example_spread),
            "examples": [e.to_json() for e in self.examples],
            "first_jump": first.to_json() if first else None,
            "layers": [r.to_json() for r in self.layers], "layer_source": self.layer_source,
            "injected_positions": self.injected,
            "replay": _json_safe(self.replay.to_json()) if self.replay else None, "notes": self.notes,
        }


def check_step(run: Run, step: int, window: int, checkpoints: list[int]) -> int:
    """The checkpoint to replay from; raises SpikeInputError for a step spike analysis cannot use."""
    trace = run.trace
    if len(trace) == 0:
        raise SpikeInputError(f"{run.path}: the trace holds no steps (was it recorded with trace.level=off?)")
    if not trace.start <= step < trace.end:
        raise SpikeInputError(f"--step {step} is outside the recorded steps {trace.start}..{trace.end - 1} of {run.path}")
    before = step - trace.start
    if before < window:
        hint = (f"pass --window {before} or less" if before >= MIN_WINDOW
                else f"a baseline needs at least {MIN_WINDOW} recorded steps before it")
        raise SpikeInputError(f"step {step} has {before} recorded steps before it, too few for a baseline of "
                              f"--window {window}: {hint}")
    usable = [c for c in checkpoints if c <= step]
    if not usable:
        have = ", ".join(map(str, checkpoints)) or "none"
        raise SpikeInputError(f"{run.path} has no checkpoint at or before step {step} (checkpoints: {have}); "
                              "spike replay starts from a checkpoint: pick a spike after one")
    return max(usable)


def injected_positions(run: Run, step: int) -> list[int]:
    """Positions a recorded bad-batch fault replaced at `step` (empty for other runs)."""
    specs = run.manifest.get("faults") or []
    if f"bad-batch@{step}" not in specs:
        return []
    from trainer.faults import bad_positions

    return bad_positions(run.schema.examples_per_step)


class _Capture:
    """Wraps a replayable for the engine and keeps the replayed records of the steps >= `keep_from`.
    `layer_step`, when given, runs those steps instead (a trainer's step forced to the layer level)."""

    def __init__(self, inner: Any, keep_from: int, layer_step: Callable | None = None):
        self.inner, self.keep_from, self.layer_step = inner, keep_from, layer_step
        self.schema = inner.schema
        self.records: dict[int, StepRecord] = {}

    def checkpoint_steps(self) -> list[int]:
        return self.inner.checkpoint_steps()

    def restore(self, step: int) -> Any:
        return self.inner.restore(step)

    def step(self, state: Any, step: int):
        import jax

        from trainer.recorder import to_record

        keep = step >= self.keep_from
        fn = self.layer_step if keep and self.layer_step is not None else self.inner.step
        state, metrics, hashes = fn(state, step)
        if keep:
            self.records[step] = to_record(self.schema, step, jax.device_get(metrics), hashes)
        return state, metrics, hashes


def _layer_level_step(replayable: Any) -> Callable | None:
    """A trainer replayable's step at the layer level on every step (same training results)."""
    built = getattr(replayable, "built", None)
    if built is None or "layer" not in getattr(built, "compiled", {}):
        return None
    cfg = built.cfg
    every = dataclasses.replace(cfg, trace=dataclasses.replace(cfg.trace, layer_every=1))
    return dataclasses.replace(built, cfg=every).run_step


def fed_tokens(replayable: Any, step: int) -> np.ndarray | None:
    """int32 [B, seq_len + 1]: the global batch a trainer run fed at `step` (faults applied), or
    None where the replayable is not the trainer's."""
    built = getattr(replayable, "built", None)
    if built is None:
        return None
    from trainer import data

    plan = built.faults
    source_step = plan.batch_step(step) if plan else step
    rows = data.load_batch(built.source, built.batcher.global_ids(source_step), built.cfg.model.seq_len)
    if plan:
        batch = data.Batch(rows[:, :-1], rows[:, 1:], data.example_hashes(rows), built.batcher.global_ids(source_step))
        batch = plan.alter_batch(batch, step, slice(0, rows.shape[0]))
        rows = np.concatenate([batch.inputs_BxL[:, :1], batch.targets_BxL], axis=1)
    return np.ascontiguousarray(rows, np.int32)


def decode_tokens(run: Run, tokens: np.ndarray) -> str | None:
    """The byte tokenizer's text of `tokens` (None for runs with another vocabulary): control
    characters escaped, runs of 4 or more of one character written once with "×n"."""
    import itertools

    from trainer import tokenizer

    vocab = run.manifest.get("config", {}).get("model", {}).get("vocab_size")
    if vocab != tokenizer.VOCAB_SIZE:
        return None
    parts = []
    for c, group in itertools.groupby(tokenizer.decode(tokens)):
        n = len(list(group))
        shown = c if c.isprintable() else repr(c)[1:-1]
        parts.append(f"{shown}×{n}" if n >= 4 else shown * n)
    return "".join(parts)


def _seen_before(run: Run, step: int, hashes_B: np.ndarray) -> list[int | None]:
    """For each hash, the first step before `step` whose batch held it."""
    trace = run.trace
    first: list[int | None] = [None] * len(hashes_B)
    todo = {int(h): [] for h in hashes_B}
    for i, h in enumerate(hashes_B):
        todo[int(h)].append(i)
    wanted = np.array(sorted(todo), np.uint64)
    for rec in trace.records(trace.start, step):
        hit = np.isin(rec.example_hashes, wanted)
        if not hit.any():
            continue
        for h in rec.example_hashes[hit]:
            for i in todo.pop(int(h), []):
                first[i] = rec.step
        if not todo:
            break
        wanted = np.array(sorted(todo), np.uint64)
    return first


def _metric_spike(values_W: np.ndarray, value: float, step: int) -> Spike:
    base, spread = robust(values_W)
    spread = max(spread, REL_FLOOR * abs(base)) if math.isfinite(base) else spread
    score = (value - base) / spread if math.isfinite(value) else math.inf
    return Spike(step, value, base, spread, score)


def analyze(run: Run, replayable: Any, step: int, contract: Any, window: int = DEFAULT_WINDOW,
            threshold: float = DEFAULT_THRESHOLD, top: int = DEFAULT_TOP,
            on_step: Callable[[StepResult], None] | None = None) -> SpikeReport:
    """Replays from the nearest checkpoint at or before `step` through `step` (verifying every
    field, as `replay run` does) and reports what drives the loss at `step`."""
    from replay.engine import replay

    check_window(window, threshold)
    start = check_step(run, step, window, replayable.checkpoint_steps())
    schema = run.schema
    trace = run.trace
    first = step - window
    window_recs = list(trace.records(first, step))
    at = trace.read(step)
    layer_step = _layer_level_step(replayable) if at.rms is None and schema.tensors else None
    capture = _Capture(replayable, max(first, start), layer_step)
    report_replay = replay(run, capture, step, step, contract, on_step)
    replayed = capture.records

    loss_i = schema.metric_index("loss")
    loss = _metric_spike(np.array([r.metrics[loss_i] for r in window_recs]), float(at.metrics[loss_i]), step)
    grad = None
    if "grad_norm" in schema.metric_names:
        g = schema.metric_index("grad_norm")
        grad = _metric_spike(np.array([r.metrics[g] for r in window_recs]), float(at.metrics[g]), step)

    notes: list[str] = []
    # Examples ------------------------------------------------------------------------------
    examples: list[ExampleRow] = []
    typical = spread_e = math.nan
    if "loss" in schema.example_metrics and at.example_metrics is not None:
        e = schema.example_metrics.index("loss")
        pool = np.concatenate([r.example_metrics[e] for r in window_recs if r.example_metrics is not None] or [[]])
        pool = pool[np.isfinite(pool)]
        if pool.size:
            typical, spread_e = robust(pool, REL_FLOOR * abs(float(np.median(pool))))
        else:
            notes.append("the window holds no finite per-example losses: example scores are not available")
        ex_loss = at.example_metrics[e].astype(np.float64)
        batch = ex_loss.size
        rise = loss.loss - loss.baseline if loss.loss > loss.baseline else math.nan  # shares only of a rise
        order = sorted(range(batch), key=lambda i: (0 if not np.isfinite(ex_loss[i]) else 1, -np.nan_to_num(ex_loss[i]), i))
        chosen = order[:max(1, top)]
        seen = _seen_before(run, step, at.example_hashes[chosen])
        tokens = fed_tokens(replayable, step)
        if tokens is not None:
            from trainer.data import example_hashes

            if not np.array_equal(example_hashes(tokens), at.example_hashes):
                notes.append("the data source does not give the recorded example hashes at this step; tokens not shown")
                tokens = None
        for i, pos in enumerate(chosen):
            h = int(at.example_hashes[pos])
            dup = [int(p) for p in np.nonzero(at.example_hashes == at.example_hashes[pos])[0] if p != pos]
            row_tokens = tokens[pos, :DECODE_TOKENS] if tokens is not None else None
            examples.append(ExampleRow(
                int(pos), float(ex_loss[pos]), (float(ex_loss[pos]) - typical) / spread_e,
                (float(ex_loss[pos]) - typical) / batch / rise if rise and math.isfinite(rise) else math.nan,
                h, seen[i], dup,
                None if row_tokens is None else [int(t) for t in row_tokens],
                None if row_tokens is None else decode_tokens(run, row_tokens)))
    else:
        notes.append("the trace holds no per-example losses at this step")

    # Layers --------------------------------------------------------------------------------
    layers: list[LayerRow] = []
    source = None
    rms_at = at.rms
    if rms_at is not None:
        source = "recorded"
    elif step in replayed and replayed[step].rms is not None:
        rms_at, source = replayed[step].rms, "replayed"
    if rms_at is not None:
        hist = []
        for r in window_recs:
            rms = r.rms if r.rms is not None else (replayed[r.step].rms if r.step in replayed else None)
            if rms is not None:
                hist.append(rms)
        if len(hist) >= MIN_WINDOW:
            log_hist = np.log(np.maximum(np.stack(hist).astype(np.float64), 1e-30))
            for j, (name, kind) in enumerate(schema.tensors):
                if kind not in ("forward", "backward"):
                    continue
                med, spread = robust(log_hist[:, j], LOG_FLOOR)
                value = float(rms_at[j])
                if math.isfinite(value) and value > 0:
                    score = (math.log(value) - med) / spread
                else:  # NaN or inf RMS: a jump by definition; zero: a collapse
                    score = -math.inf if value == 0 else math.inf
                layers.append(LayerRow(name, kind, value, math.exp(med), value / math.exp(med), score,
                                       abs(score) >= threshold))
        else:
            notes.append(f"only {len(hist)} steps of the window have layer RMS values: too few for a layer baseline")
            source = None
    else:
        notes.append("no layer RMS at this step (recorded at the step level only, and not replayable at the layer level)")
    if source == "replayed":
        notes.append("layer RMS at this step come from the replay (the trace records layers every "
                     f"{run.manifest.get('config', {}).get('trace', {}).get('layer_every', '?')} steps)")
    return SpikeReport(str(run.path), step, (first, step - 1), threshold, loss, grad, typical, spread_e, examples,
                       layers, source, report_replay, injected_positions(run, step), notes,
                       {k: r.rms for k, r in replayed.items() if r.rms is not None})


# ------------------------------------------------------------------------------- outputs

def save_batch(replayable: Any, run: Run, step: int, out: str | Path) -> Path:
    """Writes the batch fed at `step` (int32 [B, seq_len + 1]: inputs are [:, :-1], targets [:, 1:])
    after checking that its rows hash to the recorded example hashes."""
    tokens = fed_tokens(replayable, step)
    if tokens is None:
        raise SpikeInputError(f"{run.path} was recorded by another training loop; --save-batch needs a trainer run")
    from trainer.data import example_hashes

    if not np.array_equal(example_hashes(tokens), run.trace.read(step).example_hashes):
        raise SpikeInputError(f"the data source no longer gives the batch recorded at step {step} (example hashes "
                              "differ); pass --data PATH to the original data")
    out = Path(out)
    np.save(out, tokens)
    return out


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
    axes[0].set_title(f"{run.path.name}: step {step} (score {report.loss.score:.1f}); shaded: baseline window")
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
    ax.set_title(f"{run.path.name}: {len(result.spikes)} spike(s) at threshold {result.threshold:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
