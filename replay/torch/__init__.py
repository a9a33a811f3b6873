"""replay.torch: record a PyTorch training loop into replay's run format (never imports JAX).

    import replay.torch
    run = replay.torch.init("runs/ref", config=cfg, model=model, optimizer=opt)
    for k in range(steps):
        with run.step(rows) as rec:          # the step's token rows [B, L+1]
            loss = loss_fn(model(rows[:, :-1]), rows[:, 1:])
            loss.backward()
            opt.step()
            rec.metrics(loss=loss)
        opt.zero_grad()
    run.finish()

A crashed run continues with `run = replay.torch.init(PATH, ..., resume=True)` and
`for k in range(run.restore(model, opt), steps)`: the newest checkpoint (replay.torch.checkpoint)
is loaded and the steps after it are re-recorded, kept only if bit-identical (run.py).

Per step it records the per-example hashes of the rows (equal to the JAX side's for equal rows),
the metrics as exact float32 bits, a hash of the RNG state, and at the layer level the tensor
fingerprints of traces/fingerprint.py: the parameters and optimizer state entering the step,
every layer's forward output (module forward hooks), every gradient after backward, every
parameter after the optimizer step, each with its distance sketch (traces/sketch.py; trace
format_version 2), from which bisect measures how far a JAX run is from this one. `names=` records them under another framework's names and
layouts (trainer/reference.py: the JAX trainer's), so the two runs' tensors pair by name.

    fingerprint.py  the tensor fingerprint in torch ops (fingerprint.fingerprint: one tensor's)
    sketch.py       the distance sketch in torch ops (sketch.sketch: one tensor's)
    hashing.py      per-example hashes of a torch batch, the batch hash
    names.py        which tensors, under which names and layouts
    taps.py         the hooks that fingerprint them inside a step
    step.py         `with run.step(batch) as rec`, and the record until it is written
    run.py          replay.torch.init and the run it returns
"""

from replay.torch.errors import TorchRecordError
from replay.torch.hashing import batch_hash, example_hashes
from replay.torch.names import ParamName, TensorNames
from replay.torch.run import TorchRun, init

__all__ = ["ParamName", "TensorNames", "TorchRecordError", "TorchRun", "batch_hash", "example_hashes", "init"]
