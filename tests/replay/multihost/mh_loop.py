"""A data-parallel user loop recorded on several processes (tests/replay/test_multihost_loop.py).

    python mh_loop.py RUN PROCESSES PROCESS_ID PORT LR

Each process holds 2 CPU devices (XLA_FLAGS set by the test) and feeds the rows of its block of
the global batch; with PROCESSES=1 one process holds all 4 devices and feeds every row. The step
is jitted with the shardings it is fed, so one process and two compile the same program.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import replay

B, D, STEPS, EVERY = 8, 4, 6, 3


def batch_at(step: int) -> dict:
    rng = np.random.default_rng([11, step])
    return {"x": rng.normal(size=(B, D)).astype(np.float32), "y": rng.normal(size=(B,)).astype(np.float32)}


def _shardings():
    # Auto axes: the loop the trainer-style multi-host tests were written for (explicit: test_explicit_sharding.py)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def init() -> dict:
    replicated, _ = _shardings()
    return jax.device_put({"w": jnp.linspace(-1.0, 1.0, D, dtype=jnp.float32), "step": jnp.int32(0)}, replicated)


def train_step(state: dict, batch: dict, lr: float) -> tuple[dict, dict]:
    def loss_fn(w):
        per = (batch["x"] @ w - batch["y"]) ** 2
        return jnp.mean(per), per

    (loss, per), grad = jax.value_and_grad(loss_fn, has_aux=True)(state["w"])
    replay.tap(grad, "grad")
    return {"w": state["w"] - lr * grad, "step": state["step"] + 1}, {"loss": loss, "example_loss": per}


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    replicated, data = _shardings()
    step = jax.jit(functools.partial(train_step, lr=config["lr"]), in_shardings=(replicated, data),
                   out_shardings=(replicated, replicated))
    return replay.Loop(step=step, batch_at=batch_at, init=init)


def main(path: str, processes: int, pid: int, port: str, lr: float) -> None:
    if processes > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes, process_id=pid)
    config = {"lr": lr}
    loop = make(config)
    run = replay.init(path, config=config, entrypoint=make)
    step = run.step(batch_axis=0)(loop.step)
    _, data = _shardings()
    mine = slice(pid * B // processes, (pid + 1) * B // processes)
    state = loop.init()
    for k in range(STEPS):
        if k % EVERY == 0:
            run.save(k, state)
        rows = {name: x[mine] for name, x in batch_at(k).items()}
        batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(data, x, (B, *x.shape[1:])), rows)
        state, _ = step(state, batch)
    run.save(STEPS, state)
    run.finish()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
