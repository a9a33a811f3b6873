"""Analysis of one loss spike (`replay spike RUN --step S`): replays the window bit-exactly and
ranks the examples and layers that drive the loss at S (method in replay/spike/__init__.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from replay.spike.detect import (DECODE_TOKENS, DEFAULT_METRIC, DEFAULT_THRESHOLD, DEFAULT_TOP, DEFAULT_WINDOW, LOG_FLOOR,
                                 MIN_WINDOW, REL_FLOOR, Spike, SpikeInputError, _json_safe, _num, check_metric,
                                 check_window, robust, shown)
from traces import Run, StepRecord, first_fed

if TYPE_CHECKING:  # the engine imports JAX; `replay spike RUN` (detection only) never needs it
    from replay.engine.engine import ReplayReport, StepResult


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
        raise SpikeInputError(f"{shown(run)}: the trace holds no steps (was it recorded with trace.level=off?)")
    if not trace.start <= step < trace.end:
        raise SpikeInputError(f"--step {step} is outside the recorded steps {trace.start}..{trace.end - 1} of {shown(run)}")
    before = step - trace.start
    if before < window:
        hint = (f"pass --window {before} or less" if before >= MIN_WINDOW
                else f"a baseline needs at least {MIN_WINDOW} recorded steps before it")
        raise SpikeInputError(f"step {step} has {before} recorded steps before it, too few for a baseline of "
                              f"--window {window}: {hint}")
    from replay.engine.engine import latest_checkpoint

    start = latest_checkpoint(checkpoints, step)
    if start is None:
        have = ", ".join(map(str, checkpoints)) or "none"
        raise SpikeInputError(f"{shown(run)} has no checkpoint at or before step {step} (checkpoints: {have}); "
                              "spike replay starts from a checkpoint: pick a spike after one")
    return start


def injected_positions(replayable: Any, step: int) -> list[int]:
    """Positions of the batch at `step` a recorded fault replaced (the run's loop's
    `injected_positions(step) -> list[int]`; empty where it has none: nothing was injected)."""
    positions = getattr(replayable, "injected_positions", None)
    return [] if positions is None else [int(p) for p in positions(step)]


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

        from replay.record.recorder import to_record

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


TOKEN_ROWS = ("fed_rows", "fed_rows(step) -> int32 [B, L+1], the token rows the step was fed")


def fed_tokens(replayable: Any, step: int) -> np.ndarray | None:
    """int32 [B, seq_len + 1]: the global batch the run fed at `step` (faults applied), from its
    loop's `fed_rows(step)`, or None where the loop declares no token rows. Cost: B rows read."""
    rows = getattr(replayable, TOKEN_ROWS[0], None)
    return None if rows is None else np.ascontiguousarray(rows(step), np.int32)


def _rows_match(replayable: Any, tokens: np.ndarray, recorded: np.ndarray) -> bool:
    """Whether `tokens` hash to the recorded example hashes (the loop's `example_hashes(rows)`,
    else replay's hash of one-array batches, which is the trainer's bit for bit)."""
    hashes = getattr(replayable, "example_hashes", None)
    if hashes is None:
        from replay.record.hashing import leaf_hashes

        rows = np.ascontiguousarray(tokens.astype(tokens.dtype.newbyteorder("<"), copy=False))
        return np.array_equal(leaf_hashes([("batch", rows)]), recorded)
    return np.array_equal(hashes(tokens), recorded)


def decode_tokens(replayable: Any, tokens: np.ndarray) -> str | None:
    """The text of `tokens` by the run's loop's `decode_tokens(tokens) -> str | None` (the trainer's:
    the byte tokenizer, control characters escaped, runs of 4+ written once with "×n"), or None."""
    decode = getattr(replayable, "decode_tokens", None)
    return None if decode is None else decode(tokens)


def _seen_before(run: Run, step: int, hashes_B: np.ndarray) -> list[int | None]:
    """For each hash, the first step before `step` whose batch held it (traces.first_fed: the
    segments' sorted-hash indexes, every hit confirmed in its record; no scan of the run)."""
    first = first_fed(run, [int(h) for h in hashes_B], before_step=step)
    return [first.get(int(h)) for h in hashes_B]


def _metric_spike(values_W: np.ndarray, value: float, step: int) -> Spike:
    base, spread = robust(values_W)
    spread = max(spread, REL_FLOOR * abs(base)) if math.isfinite(base) else spread
    score = (value - base) / spread if math.isfinite(value) else math.inf
    return Spike(step, value, base, spread, score)


def analyze(run: Run, replayable: Any, step: int, contract: Any, window: int = DEFAULT_WINDOW,
            threshold: float = DEFAULT_THRESHOLD, top: int = DEFAULT_TOP,
            on_step: Callable[[StepResult], None] | None = None, metric: str = DEFAULT_METRIC) -> SpikeReport:
    """Replays from the nearest checkpoint at or before `step` through `step` (verifying every
    field, as `replay run` does) and reports what drives the loss at `step`."""
    from replay.engine.engine import replay

    check_window(window, threshold)
    loss_i = check_metric(run, metric)  # before replaying anything
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

    loss = _metric_spike(np.array([r.metrics[loss_i] for r in window_recs]), float(at.metrics[loss_i]), step)
    grad = None
    if "grad_norm" in schema.metric_names:
        g = schema.metric_index("grad_norm")
        grad = _metric_spike(np.array([r.metrics[g] for r in window_recs]), float(at.metrics[g]), step)

    notes: list[str] = []
    # Examples ------------------------------------------------------------------------------
    examples: list[ExampleRow] = []
    typical = spread_e = math.nan
    if metric in schema.example_metrics and at.example_metrics is not None:
        e = schema.example_metrics.index(metric)
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
        if tokens is None:
            notes.append(f"the examples' tokens are not shown: the run's loop does not provide {TOKEN_ROWS[1]}")
        elif not _rows_match(replayable, tokens, at.example_hashes):
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
                None if row_tokens is None else decode_tokens(replayable, row_tokens)))
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
    return SpikeReport(shown(run), step, (first, step - 1), threshold, loss, grad, typical, spread_e, examples,
                       layers, source, report_replay, injected_positions(replayable, step), notes,
                       {k: r.rms for k, r in replayed.items() if r.rms is not None})


# ------------------------------------------------------------------------------- outputs

def check_save_batch(replayable: Any, run: Run) -> None:
    """SpikeInputError unless the run's loop gives its token rows (asked before anything is replayed)."""
    if getattr(replayable, TOKEN_ROWS[0], None) is None:
        raise SpikeInputError(f"{shown(run)}: its loop does not provide {TOKEN_ROWS[1]}; --save-batch needs a run "
                              "whose loop declares its token rows")


def save_batch(replayable: Any, run: Run, step: int, out: str | Path) -> Path:
    """Writes the batch fed at `step` (int32 [B, seq_len + 1]: inputs are [:, :-1], targets [:, 1:])
    after checking that its rows hash to the recorded example hashes."""
    check_save_batch(replayable, run)
    tokens = fed_tokens(replayable, step)
    if not _rows_match(replayable, tokens, run.trace.read(step).example_hashes):
        raise SpikeInputError(f"the data source no longer gives the batch recorded at step {step} (example hashes "
                              "differ); pass --data PATH to the original data")
    out = Path(out)
    np.save(out, tokens)
    return out
