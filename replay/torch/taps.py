"""Hooks on a torch model that fingerprint, inside a recorded step, what the trace records.

    state/params      the parameters entering the step (one summary of all of them)
    state/opt_state   the optimizer's state entering the step (when an optimizer is given)
    <layer>           each layer's forward output: a module forward hook, in execution order
    grad/<param>      each parameter's gradient, when backward has accumulated it (a
                      post-accumulate-grad hook, so a later in-place clip does not change it:
                      the raw gradient, as the JAX trainer records), last layer first
    param/<param>     each parameter after the step (the optimizer's update), in execution order

Everything is computed on the tensors' device and kept there: a record is fetched one step
late (replay/torch/run.py). Cost per step: one fingerprint pass over every recorded activation,
gradient and parameter (a parameter's is reused as the next step's state when the parameter
has not changed since); no copy of a tensor, only of one chunk of a transposed one at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from replay.torch.errors import TorchRecordError
from replay.torch.fingerprint import lanes_and_sum_of_squares, words_lanes
from replay.torch.names import TensorNames, leaf_modules, resolve
from replay.torch.sketch import sketch_and_norm

# (int64[2] lanes, float64 sum of squares, elements, float64[W] sketch or None, float64 its sum of squares or None)
Summary = tuple[torch.Tensor, torch.Tensor, int, "torch.Tensor | None", "torch.Tensor | None"]


def _summary(t: torch.Tensor, width: int = 0) -> Summary:
    lanes, ss = lanes_and_sum_of_squares(t)
    sketch, sketch_ss = sketch_and_norm(t, width) if width else (None, None)
    return lanes, ss, t.numel(), sketch, sketch_ss


def _tree(parts: list[Summary], device: torch.device, width: int = 0) -> Summary:
    """The trainer's pytree summary: the fingerprint of the leaves' lanes stacked as uint32[T, 2];
    its sketch the sum of the leaves' sketches (traces/FORMAT.md, "Distance sketches")."""
    sketch = sketch_ss = None
    if width:
        sketch = torch.zeros(width, dtype=torch.float64, device=device)
        sketch_ss = torch.zeros((), dtype=torch.float64, device=device)
        for p in parts:
            sketch, sketch_ss = sketch + p[3].to(device), sketch_ss + p[4].to(device)
    if not parts:
        return (torch.zeros(2, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.float64, device=device), 0,
                sketch, sketch_ss)
    stacked = torch.stack([p[0].to(device) for p in parts])
    return (words_lanes(stacked, "uint32"), sum(p[1].to(device) for p in parts), sum(p[2] for p in parts),
            sketch, sketch_ss)


def _output_tensor(out: Any) -> torch.Tensor | None:
    """A layer's output: a tensor, or the first element of a tuple (older HF decoder layers)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class Taps:
    def __init__(self, model: torch.nn.Module, names: TensorNames, optimizer: Any = None, sketch_width: int = 0):
        self.params, layers = resolve(model, names)
        self.width = sketch_width
        self.optimizer = optimizer
        self.discover = layers is None
        self.layer_names: list[str] | None = None if self.discover else [n for n, _ in layers]
        self.active = False
        self._fwd: dict[str, list[Summary]] = {}
        self._grads: dict[str, Summary] = {}
        self._last_params: tuple[list, list[Summary]] | None = None  # (versions, summaries) after the last step
        self._handles = []
        for name, module in (leaf_modules(model) if self.discover else layers):
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
        for entry, param in self.params:
            self._handles.append(param.register_post_accumulate_grad_hook(self._grad_hook(entry)))
        self.device = self.params[0][1].device if self.params else torch.device("cpu")

    # ------------------------------------------------------------------------------ hooks

    def _forward_hook(self, name: str):
        def hook(module, args, out):
            if not self.active:
                return
            if self.discover:  # only a module that returns one tensor is a layer (not a rotary (cos, sin) pair)
                if not isinstance(out, torch.Tensor):
                    return
                t = out
            else:
                t = _output_tensor(out)
                if t is None:
                    raise TorchRecordError(f"layer {name} returned a {type(out).__name__}, not a tensor; map the "
                                           "layer to a module whose output is the tensor to record")
            self._fwd.setdefault(name, []).append(_summary(t, self.width))
        return hook

    def _grad_hook(self, entry):
        def hook(param):
            if self.active and param.grad is not None:  # fires per backward: the last (the sum) wins
                self._grads[entry.trace] = _summary(entry.view(param.grad), self.width)
        return hook

    # ------------------------------------------------------------------------------ a step

    def begin(self) -> None:
        self._fwd, self._grads = {}, {}
        self._state = [self._params_summary(), *([self._opt_summary()] if self.optimizer is not None else [])]
        self.active = True

    def abort(self) -> None:
        self.active = False
        self._fwd, self._grads = {}, {}

    def end(self, step: int) -> tuple[list[tuple[str, str]], list[Summary], list[str]]:
        """((name, kind) of every tensor in schema order, their summaries, forward layers that ran
        twice) for the step that just ran."""
        self.active = False
        fired = list(self._fwd)
        if self.layer_names is None:  # the first step fixes the discovered layers, in execution order
            self.layer_names = fired
        elif set(fired) != set(self.layer_names):
            missing = [n for n in self.layer_names if n not in self._fwd]
            extra = [n for n in fired if n not in self.layer_names]
            raise TorchRecordError(f"step {step}: the forward pass ran different layers than the run records (missing: "
                                   f"{', '.join(missing[:3]) or 'none'}; new: {', '.join(extra[:3]) or 'none'}); a "
                                   "recorded step runs the same model every step")
        twice = [n for n in self.layer_names if len(self._fwd[n]) > 1]
        kinds = [("state/params", "state")] + ([("state/opt_state", "state")] if self.optimizer is not None else [])
        summaries = list(self._state)
        kinds += [(n, "forward") for n in self.layer_names]
        summaries += [self._fwd[n][0] for n in self.layer_names]
        for entry, param in reversed(self.params):
            kinds.append((f"grad/{entry.trace}", "backward"))
            summaries.append(self._grads.get(entry.trace) or self._late_grad(entry, param))
        after = [_summary(entry.view(param), self.width) for entry, param in self.params]
        self._last_params = (self._versions(), after)
        kinds += [(f"param/{entry.trace}", "update") for entry, _ in self.params]
        summaries += after
        self._second_calls = {n: self._fwd[n] for n in twice}
        self._fwd, self._grads = {}, {}
        return kinds, summaries, twice

    def second_calls(self) -> dict[str, list[Summary]]:
        """Every summary of the layers that ran more than once in the last step (checked on the host:
        an activation-checkpointing recompute gives the same bits, a second microbatch does not)."""
        return getattr(self, "_second_calls", {})

    def _late_grad(self, entry, param) -> Summary:
        # No hook fired this step: a gradient assigned by hand, or none (an unused parameter, for
        # which JAX's grad is zeros, and so is this record).
        g = param.grad if param.grad is not None else torch.zeros_like(param)
        return _summary(entry.view(g), self.width)

    def _versions(self) -> list:
        return [(p.data_ptr(), p._version, tuple(p.shape)) for _, p in self.params]

    def _params_summary(self) -> Summary:
        if self._last_params is not None and self._last_params[0] == self._versions():
            parts = self._last_params[1]  # unchanged since the last step's param/* pass
        else:
            parts = [_summary(entry.view(param), self.width) for entry, param in self.params]
        return _tree(parts, self.device, self.width)

    def _opt_summary(self) -> Summary:
        """The optimizer's state tensors in parameter order, each slot's keys sorted, in the trace layout."""
        parts = []
        for entry, param in self.params:
            state = self.optimizer.state.get(param, {})
            for key in sorted(state):
                v = state[key]
                if isinstance(v, torch.Tensor):
                    parts.append(_summary(entry.view(v) if v.shape == param.shape else v, self.width))
        return _tree(parts, self.device, self.width)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
