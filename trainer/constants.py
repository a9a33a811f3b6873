"""The trainer's constants, each defined once (tests/test_constants.py fails on a second definition).

No JAX, no trainer import: trainer/plan.py reads these without starting JAX, and trainer/mesh.py,
step.py, microbatches.py and invariant.py import each other, so the one home sits below all of them.
"""

# What `trace.level` records per step (trainer/step.py): "off" the training outputs only, "step"
# the scalar metrics, "layer" also per-tensor fingerprints. Not replay.init's recording levels
# (replay/record/options.py RECORD_LEVELS), which have no "off": an unrecorded step is not wrapped.
TRACE_LEVELS = ("off", "step", "layer")

# The mesh axes the batch axis is split over (both: data-parallel and FSDP devices each hold rows).
BATCH_AXES = ("data", "fsdp")
