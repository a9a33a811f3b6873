"""Loss spikes: find them in a recorded run, replay one bit-exactly, and show what drives it.

Detection (`scan`) reads only the trace. A step's loss is compared with the steps before it:

    baseline  = median of the finite losses of the previous `window` steps
    spread    = 1.4826 * MAD of those losses (the MAD scaled to a normal's sigma), at least
                REL_FLOOR * |baseline| so a flat loss cannot make any wobble a spike
    score     = (loss - baseline) / spread        a spike when score >= threshold

The median and MAD are robust: a spike inside the window barely moves them, and a falling
loss (early training) only lowers scores. A non-finite loss is always a spike.

Analysis (`analyze`) of one step S replays the steps from the nearest checkpoint at or before S
through S with the replay engine (replay/engine/engine.py: every recorded field of every replayed
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

Layout: detection in replay/spike/detect.py (no JAX), the analysis of one step in
replay/spike/analysis.py, the plots in replay/spike/plot.py; this module re-exports them.

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

from replay.spike.analysis import (ExampleRow, LayerRow, SpikeReport, analyze, check_step, decode_tokens, fed_tokens,
                                   injected_positions, save_batch)
from replay.spike.detect import (DECODE_TOKENS, DEFAULT_METRIC, DEFAULT_THRESHOLD, DEFAULT_TOP, DEFAULT_WINDOW, LOG_FLOOR, MAD_SCALE,
                                 MIN_WINDOW, REL_FLOOR, Scan, Spike, SpikeInputError, check_metric, check_window, robust,
                                 rolling_scores, scan)
from replay.spike.plot import plot_scan, plot_spike

__all__ = [
    "DECODE_TOKENS", "DEFAULT_METRIC", "DEFAULT_THRESHOLD", "DEFAULT_TOP", "DEFAULT_WINDOW", "LOG_FLOOR", "MAD_SCALE", "MIN_WINDOW",
    "REL_FLOOR", "ExampleRow", "LayerRow", "Scan", "Spike", "SpikeInputError", "SpikeReport", "analyze", "check_step",
    "check_metric", "check_window", "decode_tokens", "fed_tokens", "injected_positions", "plot_scan", "plot_spike", "robust",
    "rolling_scores", "save_batch", "scan",
]
