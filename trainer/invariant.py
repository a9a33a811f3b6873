"""Mesh-invariant mode: the same bits from a train step on any device count.

Enabled with `--set mesh.mesh_invariant=true mesh.n_microbatches=M`. The scheme:

    1. The global batch is cut into M microbatches of global_batch / M examples, in global
       example order. M is fixed by the config, not by the device count. On n devices, n a
       power of two, device d computes microbatches d, d + n, d + 2n, ... (strided: it takes
       them from the batch's tokens, all-gathered; tokens are small); otherwise it computes
       its M / n consecutive ones.
    2. Inside shard_map, each device runs its microbatches one by one (lax.scan) through
       `step.loss_fn` with the parameters replicated (FSDP-sharded parameters are all-gathered
       before the shard_map, which only copies bits). Every microbatch therefore has the same
       shape and the same program on any device count. Dropout uses
       fold_in(step key, global microbatch index), so its bits do not depend on the layout.
    3. The per-microbatch gradients are summed with one fixed pairwise tree over the M
       microbatches (`pair_tree`: adjacent pairs, an odd last element carried up unpaired),
       then divided by M. Strided, the n microbatches of one scan step are consecutive, a
       complete subtree: inside the scan an all_to_all hands device j shard j of all n
       gradients in global order and device j sums them with the tree (`reduce_block`); the
       tree over the steps' block sums is built as the scan goes (tree_sums.Counter: a binary
       counter of log2(steps) + 1 partial sums, exactly pair_tree's tree). Consecutive, each
       device reduces the complete subtrees it holds (a Counter capped at their level), then
       the tree over every device's partial sums is finished as a reduce-scatter
       (`scattered_sum`: all_to_all, the tree per shard). All collectives are all_to_alls and
       all_gathers: copies, never floating-point sums in an unknown order; each element sees
       the same adds in the same order on any layout.
    4. The reduced gradient leaves the shard_map as each device's shard of rows (split_axis: axis 0
       where the device count divides it, else the leaf whole), never all-gathered: the clip and
       AdamW run on the shards (XLA partitions the elementwise update; trainer/optim.py `update`
       feeds the clip the norm below with optax's arithmetic). The grad norm is computed from the
       shards in one order for every device count (tree_sums.fixed_order_sums: each leaf's squares
       summed per row by slice-add trees, the row sums all-gathered in global order, pair_tree over
       rows, then over leaves; no XLA reduce); the records' gradient RMS values come from the same
       sums, and the updated parameters' RMS is taken with the parameters whole (trainer/step.py)
       and their norm (param_norm, every level) from row shards like the gradient's
       (tree_sums.sharded_norm), so the records keep one set of bits on every count. (Until
       December 2026 param_norm was an XLA reduce over the sharded parameters: at trace level step
       1 and 4 devices recorded it 1 ULP apart; mesh-invariant runs recorded before it have other
       param_norm bits.) Per-microbatch losses, z-losses,
       per-example losses and (for layer-level records) the captured forward activations are
       all_gather'ed and put in global order; losses are combined with the same tree.
       (Session 6 left the gradient as shards with a norm over each device's shard: the norm then
       followed the layout. Session 11: the gradient all-gathered whole, as it was, held ~1 G at the
       end of the step; its grad norm bits were XLA's reduce of whole leaves, which the fixed-order
       norm does not reproduce, so mesh-invariant runs recorded before it have other grad_norm bits.)

The scheme alone is not enough on XLA:CPU. Three more things were needed, each found by
measurement (jax/jaxlib 0.10.2, x86-64 with AVX-512, 2 cores, virtual CPU devices):

    a. Fixed-order backward passes for softmax and RMSNorm (`fixed_backward=True`,
       passed to each microbatch's loss, trainer/microbatches.py). Autodiff turns the broadcast of a
       [..., 1] statistic into a plain XLA reduce, and XLA:CPU emitted the same reduce with a
       different summation order in the 1-device program than in the sharded ones.
    b. No FMA: XLA:CPU lets LLVM contract a multiply and an add into one FMA wherever both land
       in one fused kernel, and fusion depends on the whole program, i.e. on the device count
       (the AdamW update and reductions differed). `--xla_cpu_max_isa=AVX` (no FMA in AVX) in
       XLA_FLAGS. XLA reads it when the backend starts; the same option given per jit
       (compiler_options) is recorded but does not reach code generation (measured).
    c. A pinned intra-op pool: Eigen splits a matmul's work by the size of the XLA:CPU
       "XLAEigen" pool, which is max(PJRT_NPROC or the schedulable CPUs, local devices), so
       2/2/4/8 threads for 1/2/4/8 devices here. PJRT_NPROC=8 makes it 8 for up to 8 devices.
       (tiny's matmuls are too small to be split; demo's attention output gradient differed
       at 8 devices without it.)

`prepare_process()` (trainer/invariant_process.py, with the other process settings) applies b
and c before the backend starts (`build`, and the CLI when its argument is a mesh-invariant run)
and refuses in one line when the backend already runs without them. The manifest records
XLA_FLAGS, the pool size and `invariant_device_counts`.

Measured (bench/invariance.py; 10 steps of tiny, 4 of demo, n_microbatches=8, trace level
layer): which device counts give the same bits as 4 devices in every field `replay run`
verifies (loss, z-loss, grad norm, lr, param norm, per-example losses, RNG words, every
layer fingerprint: state, forward, gradients, updated parameters):

    | configuration                                  | 1 dev | 2 dev | 8 dev |
    | ---------------------------------------------- | ----- | ----- | ----- |
    | plain data parallel (tiny and demo)            |  no   |  no   |  no   |
    | scheme only (bare), tiny                       |  no   |  yes  |  yes  |
    | + a (fixed-order backward), tiny               |  no   |  yes  |  yes  |
    | + a + c (pool, FMA allowed), tiny              |  no   |  yes  |  yes  |
    | + a + b (no FMA, pool unpinned), tiny          |  yes  |  yes  |  yes  |
    | + a + b (no FMA, pool unpinned), demo          |  yes  |  yes  |  no   |
    | mesh-invariant mode (a + b + c), tiny and demo |  yes  |  yes  |  yes  |

Also identical in mesh-invariant mode (tiny): 2 processes x 2 devices (12 steps, a whole
trace); FSDP layouts data=-1 fsdp=2 and data=1 fsdp=-1 on 2, 4 and 8 devices (3 steps).
16 devices (n_microbatches=16; the pool then grows to 16): the verified fields were identical
on tiny, but that is not the pinned setting, so 16 is not in the promised set.
The RMS values a record shows beside each fingerprint are for people, not verified by replay:
they agreed on 1/2/4/8 data-parallel devices but not under FSDP or at 16 devices, where the
recording reduces sums of squares over shards (trainer/step.py). The gradient's RMS values are
its fixed-order sums (step 4) and the updated parameters' are taken whole, so data-parallel
records keep one set of bits on 1, 2, 4 and 8 devices (tests/trainer/test_invariant_claims.py).

INVARIANT_COUNTS is what a run's manifest promises (less counts its microbatches do not fit):
CPU 1, 2, 4, 8. Never promised: more than POOL_THREADS devices per process, GPUs and TPUs
(not measured), other CPU models or jaxlib versions (the contract already reports those).

Cost (bench/invariance.py --overhead, trace level step, M=8, 2 busy cores, so +-15% noise):
mesh-invariant step time / plain data parallel in the same process (same settings):

    | preset | 1 dev | 2 dev | 4 dev | 8 dev |
    | ------ | ----- | ----- | ----- | ----- |
    | demo   | 0.69  | 0.78  | 0.67  | 1.55  |
    | tiny   | 1.40  | 1.18  | 1.03  | 1.41  |

demo's 2-example microbatches run faster than whole per-device batches up to 4 devices;
tiny's steps (5-18 ms) are dominated by per-op overhead, which the scan and the gathers add
to. The process settings also slow plain code in that process (AVX without FMA, 8 threads on
2 cores): tiny 1.2-1.7x, demo ~1.1x.

Gradient memory per device (G = the gradient's bytes), strided: one microbatch's backward (XLA
reuses one leaf's buffer for the next: a few leaves in flight, plus activations), the all_to_all's
shards of one step, the Counter's log2(M / n) + 1 shards of G / n and the reduced shard. The
previous implementation stacked the M / n whole microbatch gradients and all-gathered every
device's partial sums; `gathered_sum` keeps it as the reference: bit-identical on 1, 2, 4, 8 and
2 x 2 devices, against it and a reference recorded from it (tests/trainer/test_invariant_scatter.py).
Temporaries of tiny's train step at trace level step (0.56 MB gradient, M = 64;
bench/invariant_memory.py, in G) on 2 / 4 / 8 / 64 devices: session 5 17.59 / 5.58 / 2.58 / 2.03;
the Counter, gradient gathered whole 4.89 / 2.84 / 2.09 / 2.03; the gradient left as row shards
(now) 4.90 / 2.83 / 2.08 / 1.56 (a + b / n: floor 1.28 G, was 2.01). On a wider model where
activations are small beside G (d_model 128, d_ff 512, 4 blocks, seq_len 8; G = 4.27 MB):
4.64 / 1.92 / 0.92 / 0.52 G. What does not shrink is one microbatch's backward: with the
parameters replicated inside the shard_map, each microbatch makes every leaf whole once (a few at
a time). Layer-level records all-gather every captured activation and the updated parameters.
What a device keeps of the gradient across microbatches (the Counter) and the reduced shard is
read from the traced step by trainer/gradient_memory.py (`replay plan`'s gradient_state_per_device):
(bit_length(M / n) + 1) G / n strided, shrinking as 1/devices or faster (tiny, M = 64: 3.5 / 1.5 /
0.625 / 0.032 G on 2 / 4 / 8 / 64); the temporaries less it, one microbatch's backward, stay at
1.3-1.5 G on every count. (Reducing each leaf inside the backward, a custom_vjp on the parameters
whose backward is reduce_block, was tried in session 12: XLA already schedules each leaf's
all_to_all as soon as its gradient is whole, and the temporaries did not change by a byte.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from trainer.microbatches import Layout, microbatch
from trainer.tree_sums import Counter, fixed_order_sums, pair_tree, split_axis
from trainer.config import Config
from trainer.constants import BATCH_AXES
from trainer.invariant_process import (  # noqa: F401 - the trainer, its CLI and tests name them here
    INVARIANT_COUNTS, ISA_FLAG, POOL_ENV, POOL_THREADS, invariant_counts, pool_threads, prepare_process,
    settings_problem,
)


# ------------------------------------------------------------------------------- checks

def check(cfg: Config, n_devices: int) -> None:
    """One-line MeshError unless the microbatches fit the batch and the devices."""
    from trainer.mesh import MeshError

    m, b = cfg.mesh.n_microbatches, cfg.data.global_batch_size
    if b % m:
        raise MeshError(f"mesh.n_microbatches={m} does not divide data.global_batch_size={b}; "
                        f"use a divisor of {b}")
    if m % n_devices:
        raise MeshError(f"mesh.n_microbatches={m} is not a multiple of the {n_devices} devices; mesh-invariant mode "
                        f"gives every device whole microbatches: use a multiple of {n_devices} (e.g. {n_devices * m})")


# --------------------------------------------------------------------- fixed-order sums

def _aligned_levels(local: int) -> int:
    """How many tree levels a device can do alone: log2 of the largest power of two dividing
    its (consecutive, aligned) count of microbatches."""
    k = 0
    while local % (2 << k) == 0:
        k += 1
    return k


def strided(n_devices: int) -> bool:
    """Whether microbatches are dealt out strided, device d computing d, d + n, d + 2n, ...: then
    the n microbatches of one scan step are consecutive and, n being a power of two, one complete
    subtree of the tree, reduced inside the scan (`block_sum`). Otherwise (n = 1, or not a power of
    two) each device computes consecutive microbatches and the tree is finished after the scan."""
    return n_devices > 1 and n_devices & (n_devices - 1) == 0


def block_sum(shards_Nx: jax.Array) -> jax.Array:
    """The tree over one scan step's n microbatch gradients (shards of them): the bottom log2(n)
    levels of the global tree. A name of its own so that a test can swap in another order."""
    return pair_tree(shards_Nx)


def reduce_block(g: jax.Array, n_devices: int) -> jax.Array:
    """Inside the scan (strided): this device's gradient `g` of a leaf and the other devices' of
    the same scan step -> this device's shard (split_axis) of their sum, by an all_to_all (copies,
    in device order = global microbatch order) and block_sum. A leaf without such an axis is
    all-gathered and summed whole on every device."""
    axis = split_axis(g.shape, n_devices)
    if axis is None:
        return block_sum(lax.all_gather(g, BATCH_AXES, axis=0))
    return block_sum(lax.all_to_all(g[None], BATCH_AXES, split_axis=1 + axis, concat_axis=0, tiled=True))


def shard_shape(shape: tuple[int, ...], n_devices: int) -> tuple[int, ...]:
    """A leaf's shape on one device after the reduce-scatter (split_axis cut by n; whole if None)."""
    axis = split_axis(shape, n_devices)
    return shape if axis is None else shape[:axis] + (shape[axis] // n_devices,) + shape[axis + 1:]


def gathered_sum(partials_Px: jax.Array, m_total: int) -> jax.Array:
    """After the scan (consecutive microbatches): the mean over every device's partial sums
    `partials_Px` (this device's P consecutive ones), all-gathered in global order, the tree
    finished on every device. Holds devices x P gradients per device: the previous
    implementation, kept as the reference the tests and bench/invariant_memory.py compare with."""
    return pair_tree(lax.all_gather(partials_Px, BATCH_AXES, axis=0, tiled=True)) / m_total


def scattered_sum(partials_Px: jax.Array, n_devices: int, m_total: int) -> jax.Array:
    """gathered_sum's bits as a fixed-order reduce-scatter, for device counts that are not powers
    of two: an all_to_all gives device j shard j (split_axis) of every device's partial sums in
    global order and device j finishes the same tree on its shard: this device's shard of the
    mean (the whole mean where the leaf is not split). Every element sees the same adds in the
    same order (elementwise float adds; copies in between)."""
    axis = split_axis(partials_Px.shape[1:], n_devices)
    if n_devices == 1 or axis is None:
        return gathered_sum(partials_Px, m_total)
    shards_NPx = lax.all_to_all(partials_Px, BATCH_AXES, split_axis=1 + axis, concat_axis=0, tiled=True)
    return pair_tree(shards_NPx) / m_total


# ------------------------------------------------------------------------ the gradients

def value_and_grad(params: Any, cfg: Config, batch: dict, step_key: jax.Array, capture: bool,
                   mesh: Mesh | None, reduction: str = "scatter",
                   step: jax.Array | None = None, fixed_backward: bool = True) -> tuple[tuple[jax.Array, dict], Any]:
    """((loss + z_loss, aux), grads) of the mean loss over the global batch, like
    jax.value_and_grad(step.loss_fn, has_aux=True), but computed microbatch by microbatch and
    reduced in one fixed order. grads: with "scatter" on n > 1 devices each leaf sharded by rows
    over the batch axes (split_axis), else whole; aux (replicated): loss, z_loss, example_loss
    (global order), grad_norm and grad_sums_of_squares (per leaf, tree_sums.fixed_order_sums),
    with `capture` layers (each the global-batch activation) and, trainer/sdc.py, replicas
    (check.replicas); with `step` and check.rerun_every, check (the re-run's summaries).

    `mesh`: the ("data", "fsdp") mesh the batch is sharded over; None = the first device.
    `reduction`: "scatter" (the trainer's: strided microbatches reduce-scattered in the scan where
    the device count is a power of two, else scattered_sum) or "gather" (consecutive microbatches
    and gathered_sum: the previous implementation's reduction, the reference tests compare with).
    Cost per device: one microbatch's backward, the Counter's log2(M / n) + 1 shards of G / n
    (strided; consecutive: M / n gradients), nothing that grows with the run.
    `step`: the step counter, which the re-run check needs. A FaultyConfig's SDC faults act here.
    `fixed_backward`: as microbatches.microbatch's, for every microbatch here and in the re-run.
    """
    from trainer import sdc

    mesh = mesh_or_one_device(mesh)
    n = int(mesh.devices.size)
    check(cfg, n)
    m_total = cfg.mesh.n_microbatches
    if reduction not in ("scatter", "gather"):
        raise ValueError(f"reduction {reduction!r} is not 'scatter' or 'gather'")
    stride = reduction == "scatter" and strided(n)
    finish = scattered_sum if reduction == "scatter" else (lambda x, n, m: gathered_sum(x, m))
    sharded = reduction == "scatter"  # gradients leave the shard_map as this device's shards
    local = m_total // n
    levels = _aligned_levels(local)
    faults = getattr(cfg, "sdc", ())
    replicas = capture and cfg.check.replicas
    rerun_every = cfg.check.rerun_every if step is not None else 0
    key_data = jax.random.key_data(step_key)
    step_in = jnp.zeros((), jnp.int32) if step is None else jnp.asarray(step, jnp.int32)

    def per_device(params, key_data, step_in, inputs_bxL, targets_bxL):
        me = lax.axis_index(BATCH_AXES)
        layout = Layout(n, local, m_total, stride)
        base = jax.random.wrap_key_data(key_data, impl="threefry2x32")
        tokens = layout.tokens(inputs_bxL, targets_bxL, gathered=stride or rerun_every > 0)
        checked = step_in % rerun_every == 0 if rerun_every else None

        leaves, treedef = jax.tree.flatten(params)
        # The tree over this device's terms (the scan steps' block-sum shards when strided, else
        # its microbatches' gradients up to the complete subtrees), built as the scan goes.
        counter = Counter(local, None if stride else levels)
        shapes = [shard_shape(p.shape, n) if stride else p.shape for p in leaves]
        init = [counter.init(jax.ShapeDtypeStruct(shape, p.dtype)) for shape, p in zip(shapes, leaves)]

        def body(acc, x):
            grads, aux = microbatch(params, cfg, base, capture, x[:3], fixed_backward)
            if faults:
                grads = sdc.corrupt(grads, faults, me, x[3], key_data)
            lanes = sdc.microbatch_summaries(grads, cfg) if replicas else ()
            terms = jax.tree.leaves(grads)
            if stride:  # this step's n microbatches -> this device's shard of their sum
                terms = [reduce_block(g, n) for g in terms]
            return [counter.push(c, g, x[3]) for c, g in zip(acc, terms)], (aux, lanes)

        acc, (aux_K, lanes_K) = lax.scan(body, init, layout.work(tokens, me))
        sums = [counter.finish(c) for c in acc]
        if stride:  # the Counter finished the global tree's upper levels (n = 2^k: no odd carry below)
            grads = [total / m_total for total in sums]
        else:  # local complete subtrees first, then the tree over every device's partial sums
            grads = [finish(partials, n, m_total) for partials in sums]
        # The norm from the shards, in an order no device count changes (the clip and the record use it).
        norm, sums_of_squares = fixed_order_sums(
            grads, cut, lambda rows: lax.all_gather(rows, BATCH_AXES, axis=0, tiled=True))
        grads = jax.tree.unflatten(treedef, grads)
        in_order = layout.in_order
        loss = pair_tree(in_order(aux_K["loss"])) / m_total
        z_loss = pair_tree(in_order(aux_K["z_loss"])) / m_total
        out = {"loss": loss, "z_loss": z_loss, "grad_norm": norm,
               "grad_sums_of_squares": jax.tree.unflatten(treedef, list(sums_of_squares)),
               "example_loss": in_order(aux_K["example_loss"]).reshape(m_total * mb),
               "layers": {name: in_order(x).reshape((m_total * mb,) + x.shape[2:]) for name, x in aux_K["layers"].items()}}
        main = None
        if replicas:
            main, rms_MxG = in_order(lanes_K[0]), in_order(lanes_K[1])
            out["replicas"] = (main.reshape(-1, 2), rms_MxG.reshape(-1))
        if rerun_every:  # everything inside one cond: a step that is not re-run pays for nothing else
            out["check"] = lax.cond(checked, lambda: sdc.rerun_check(params, cfg, base, tokens, layout, me, key_data,
                                                                     step_in, main, fixed_backward),
                                    lambda: sdc.no_check(m_total))
        return (loss + z_loss, out), grads

    mb = batch["inputs"].shape[0] // m_total  # examples per microbatch
    # Each gradient leaf leaves as this device's shard along split_axis (scatter, n > 1), else whole.
    leaves, treedef = jax.tree.flatten(params)
    cut = [sharded and n > 1 and split_axis(p.shape, n) is not None for p in leaves]
    grad_specs = jax.tree.unflatten(treedef, [P(*([None] * split_axis(p.shape, n)), BATCH_AXES) if c else P()
                                              for p, c in zip(leaves, cut)])
    fn = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), P(BATCH_AXES), P(BATCH_AXES)),
                       out_specs=(P(), grad_specs), check_vma=False)
    return fn(params, key_data, step_in, batch["inputs"], batch["targets"])


def mesh_or_one_device(mesh: Mesh | None) -> Mesh:
    """`mesh`, or a 1x1 mesh of the first device where a caller traces without one (a test, a bench)."""
    import numpy as np

    return Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), BATCH_AXES) if mesh is None else mesh
