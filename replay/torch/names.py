"""Which tensors of a torch model a trace records, under which names and in which layout.

By default a torch run records its parameters under their `named_parameters()` names in
torch's layout, and the output of every leaf module that returns a tensor, in the order the
first step runs them. A map (`TensorNames`) says instead: parameter P of the trace is the
torch parameter T permuted by `permute` (a Linear's [out, in] weight is a [in, out] kernel on
the JAX side), and forward layer L is the output of module M. With the map of the model a JAX
run records (trainer/reference.py builds the trainer's), the torch run's tensor names, order
and layouts are the JAX run's, so identical tensors have identical fingerprints and bisect
pairs tensors by name; the map is stored in the manifest ("names") so a report can name the
torch module beside the JAX name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replay.torch.errors import TorchRecordError


@dataclass(frozen=True)
class ParamName:
    trace: str  # the name in the trace ("block_00.attn.q.kernel"); recorded as grad/NAME and param/NAME
    torch: str  # the model.named_parameters() name ("model.layers.0.self_attn.q_proj.weight")
    permute: tuple[int, ...] | None = None  # torch dims giving the trace layout ((1, 0): transposed)

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor in the trace's layout (a view; fingerprinting copies it block by block)."""
        return t if self.permute is None else t.permute(*self.permute)


@dataclass(frozen=True)
class TensorNames:
    params: tuple[ParamName, ...]  # every trainable parameter, in execution order
    layers: tuple[tuple[str, str], ...] | None = None  # (trace name, module path) in execution order; None: discover
    source: str = "torch"  # what made the map ("torch": the model's own names), recorded in the manifest

    def to_json(self) -> dict:
        return {"source": self.source,
                "params": [[p.trace, p.torch, list(p.permute) if p.permute is not None else None] for p in self.params],
                "layers": None if self.layers is None else [list(x) for x in self.layers]}

    @classmethod
    def from_json(cls, d: dict) -> "TensorNames":
        params = tuple(ParamName(t, n, tuple(p) if p is not None else None) for t, n, p in d["params"])
        layers = None if d.get("layers") is None else tuple((str(a), str(b)) for a, b in d["layers"])
        return cls(params=params, layers=layers, source=str(d.get("source", "torch")))


def own_names(model: torch.nn.Module) -> TensorNames:
    """The model's own names: parameters in registration order, leaf-module outputs discovered."""
    return TensorNames(params=tuple(ParamName(n, n) for n, p in model.named_parameters() if p.requires_grad))


def resolve(model: torch.nn.Module, names: TensorNames) -> tuple[list[tuple[ParamName, torch.nn.Parameter]],
                                                                 list[tuple[str, torch.nn.Module]] | None]:
    """(map entry, parameter) pairs and (trace name, module) pairs, checked against the model:
    every trainable parameter is named exactly once (a map for another model is refused, not
    recorded under wrong names), every module exists, permutations fit."""
    by_name = dict(model.named_parameters())
    pairs, seen = [], set()
    for p in names.params:
        if p.torch not in by_name:
            raise TorchRecordError(f"the tensor names ({names.source}) name a parameter {p.torch!r} the model does not "
                                   f"have; build the names for this model")
        param = by_name[p.torch]
        if p.permute is not None and sorted(p.permute) != list(range(param.dim())):
            raise TorchRecordError(f"parameter {p.torch!r} has {param.dim()} dims; permute {p.permute} does not fit it")
        if id(param) in seen:
            raise TorchRecordError(f"parameter {p.torch!r} is named twice in the tensor names ({names.source})")
        seen.add(id(param))
        pairs.append((p, param))
    unnamed = [n for n, q in model.named_parameters() if q.requires_grad and id(q) not in seen]
    if unnamed:
        raise TorchRecordError(f"the tensor names ({names.source}) leave out {len(unnamed)} trainable parameter(s) "
                               f"of the model ({', '.join(unnamed[:3])}); name every one, or build the names for this model")
    traces = [p.trace for p in names.params]
    if len(set(traces)) != len(traces):
        raise TorchRecordError(f"the tensor names ({names.source}) give two parameters the same trace name")
    if names.layers is None:
        return pairs, None
    modules = dict(model.named_modules())
    missing = [m for _, m in names.layers if m not in modules]
    if missing:
        raise TorchRecordError(f"the tensor names ({names.source}) name module(s) the model does not have: "
                               f"{', '.join(missing[:3])}; build the names for this model")
    return pairs, [(t, modules[m]) for t, m in names.layers]


def leaf_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules without children (the candidates for discovered forward layers), by path."""
    return [(n or "model", m) for n, m in model.named_modules() if not any(True for _ in m.children())]
