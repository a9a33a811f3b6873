"""What `run.step(...)` was told, recorded in the manifest so replay wraps the Loop's step alike."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from replay.record.errors import RecordError

from traces.schema import METRIC_KINDS

# What run.step(level=...) records: "step" metrics, RNG words and example hashes; "layer" also
# tensor fingerprints. An unrecorded step is simply not wrapped, so there is no "off" here (the
# trainer's trace.level has one: trainer/constants.py TRACE_LEVELS).
RECORD_LEVELS = ("step", "layer")


@dataclass(frozen=True)
class StepOptions:
    batch_axis: int = 0  # the axis of every batch leaf that indexes examples
    loss: str | None = "loss"  # the metric recorded as the trace's "loss"; None: the step has no loss
    level: str = "layer"  # "step": metrics, RNG words, example hashes; "layer": also tensor fingerprints
    rng: tuple[str, ...] = ()  # state leaves (dotted tree paths) holding raw uint32 key words
    metric_kinds: dict = field(default_factory=dict)  # metric -> causal kind (default: loss, else update)
    metrics: tuple[str, ...] | None = None  # the step's outputs recorded (with the loss); None: every one
    sketch_width: int = 0  # "layer": also each tensor's W-wide distance sketch and norm (traces/sketch.py); 0: none

    def __post_init__(self):
        if not isinstance(self.batch_axis, int) or isinstance(self.batch_axis, bool) or self.batch_axis < 0:
            raise RecordError(f"run.step(batch_axis={self.batch_axis!r}): must be an axis number >= 0")
        if self.level not in RECORD_LEVELS:
            raise RecordError(f"run.step(level={self.level!r}): must be one of {', '.join(RECORD_LEVELS)}")
        if self.loss is not None and not isinstance(self.loss, str):
            raise RecordError(f"run.step(loss={self.loss!r}): name the loss metric, or pass None for a step without one")
        for name, kind in self.metric_kinds.items():
            if kind not in METRIC_KINDS:
                raise RecordError(f"run.step(metric_kinds={{{name!r}: {kind!r}}}): a kind is one of "
                                  f"{', '.join(METRIC_KINDS)}")
        object.__setattr__(self, "rng", tuple(self.rng))
        if self.metrics is not None:
            if isinstance(self.metrics, str) or not all(isinstance(m, str) for m in self.metrics):
                raise RecordError(f"run.step(metrics={self.metrics!r}): give the names of the outputs to record, "
                                  "a list of str")
            object.__setattr__(self, "metrics", tuple(self.metrics))
        if self.sketch_width:
            from traces.sketch import MAX_WIDTH, MIN_WIDTH

            w = self.sketch_width
            if isinstance(w, bool) or not isinstance(w, int) or w < 0 or w & (w - 1) or not MIN_WIDTH <= w <= MAX_WIDTH:
                raise RecordError(f"run.step(sketch_width={w!r}): a distance sketch's width is a power of two from "
                                  f"{MIN_WIDTH} to {MAX_WIDTH} (replay.torch records {_default_width()}), or 0 for none")
            if self.level != "layer":
                raise RecordError(f"run.step(sketch_width={w}) sketches the layer level's tensors; level={self.level!r} "
                                  "records none: pass level='layer' or leave sketch_width at 0")

    def to_json(self) -> dict:
        d = asdict(self)
        d["rng"] = list(self.rng)
        if self.metrics is None:
            del d["metrics"]  # as runs recorded before the option: their resume compares these options
        else:
            d["metrics"] = list(self.metrics)
        if not self.sketch_width:
            del d["sketch_width"]  # as runs recorded before the option (a resume compares these options)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "StepOptions":
        return cls(batch_axis=int(d.get("batch_axis", 0)), loss=d.get("loss", "loss"), level=d.get("level", "layer"),
                   rng=tuple(d.get("rng", ())), metric_kinds=dict(d.get("metric_kinds", {})),
                   metrics=None if d.get("metrics") is None else tuple(d["metrics"]),
                   sketch_width=int(d.get("sketch_width", 0)))


def _default_width() -> int:
    from traces.sketch import DEFAULT_WIDTH

    return DEFAULT_WIDTH
