"""Modules for models: `W4A16Linear` (an ``nn.Linear`` replacement holding a 4-bit weight), `quantize_model`,
which swaps a model's ``nn.Linear`` layers in place, `calibrate_model`, its GPTQ walk through the decoder
layers, and `fuse_projections`, which runs the projections that read one input as one matmul (see `fusion`).

These are ordinary modules built by conversion, not `kernels.kernelize` layers (a kernelize layer may
not hold state of its own, and a 4-bit weight is state).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
from typing import Iterable, Optional

import torch
from torch import nn

from . import ops
from .formats import FIELDS, GATE_UP_BLOCK, QuantizedWeight, check_swiglu_rows, quantize
from .fusion import (GATE_UP, QKV, FusedQKVProjection, GateUpMLP, HandedOffProjection, concat_weights,
                     gated_mlp_problem, interleave_gate_up, is_silu, qkv_layout_problem)
from .gptq import gptq_quantize

logger = logging.getLogger(__name__)


class W4A16Linear(nn.Module):
    """``y = x @ W.T + b`` with W stored as a `QuantizedWeight`; its tensors are buffers (state_dict, .to)."""

    def __init__(self, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        if not isinstance(qweight, QuantizedWeight):
            raise TypeError(f"qweight must be a QuantizedWeight, got {type(qweight).__name__}")
        self.out_features, self.in_features = qweight.shape
        self.group_size = qweight.group_size
        self.fmt = qweight.fmt
        self.weight_dtype = qweight.dtype
        for name in FIELDS:
            self.register_buffer(name, getattr(qweight, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _apply(self, fn, recurse=True):
        """Module-wide moves and casts (``model.to("cuda")``, ``model.to(torch.bfloat16)``, ``.half()``) move the
        quantized weight's tensors but keep their dtypes: scales and minima are part of the stored format (a cast
        of fp16 scales to bf16 would round them) and activations of either 16-bit dtype read them as they are."""
        stored = {name: self._buffers.pop(name) for name in FIELDS if self._buffers.get(name) is not None}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, t in stored.items():
                self._buffers[name] = t.to(fn(t.new_empty(0)).device)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, *, zero_point: bool | str = False,
                    fmt: str = "int4") -> "W4A16Linear":
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        qweight = quantize(linear.weight.detach(), group_size=group_size, zero_point=zero_point, fmt=fmt)
        return cls(qweight, linear.bias)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(**{name: getattr(self, name) for name in FIELDS},
                               shape=(self.out_features, self.in_features), group_size=self.group_size,
                               fmt=self.fmt, dtype=self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(ops.matmul_op, x)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` ``[..., out_features // 2]`` for a fused gate / up weight in the SwiGLU layout
        (`fusion.interleave_gate_up`): the matmul with the epilogue in its kernels, so ``[..., out_features]``
        never reaches memory. ValueError unless out_features is a multiple of 2 * GATE_UP_BLOCK."""
        check_swiglu_rows(self.out_features)
        return self._run(ops.swiglu_matmul_op, x)

    def _run(self, op, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        bias = None if self.bias is None else self.bias.to(x.dtype)
        ops.check_activation(x, (n, k), self.qweight.device, bias)
        return op(x, self.qweight, self.scales, self.zeros, self.mins, self.codebook, self.perm, bias, n, k,
                  self.group_size)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fmt={self.fmt}, group_size={self.group_size}, zero_point={self.zeros is not None}"
                + (", mins=True" if self.mins is not None else ""))


def _skip_names(skip: Iterable[str] | str) -> tuple[str, ...]:
    return (skip,) if isinstance(skip, str) else tuple(skip)


def _skipped(name: str, skip: Iterable[str]) -> bool:
    parts = name.split(".")
    return any(s == name or s in parts or name.endswith("." + s) for s in skip)


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at the dotted `name` below `root`."""
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def quantize_model(model: nn.Module, group_size: int = 128, skip: Iterable[str] = ("lm_head",), *,
                   zero_point: bool | str = False, fmt: str = "int4", calibration: Optional[Iterable] = None,
                   act_order: bool = False, damp: float = 0.01, true_sequential: bool = True,
                   fuse: bool = True) -> nn.Module:
    """Replace every ``nn.Linear`` of `model` whose qualified name does not match `skip` (a name, or a
    component of the dotted name) by a `W4A16Linear`, in place; returns `model`. Round-to-nearest, or with
    `calibration` (model inputs: token-id tensors or dicts of keyword arguments) GPTQ for the linears of the
    decoder layers (`calibrate_model`, optionally `act_order`, with `damp` added to the Hessian's diagonal as
    a fraction of its mean, each layer's linears in `true_sequential` stages) and round-to-nearest for the
    others. With `fuse` the projections that read one input then run as one matmul: q / k / v and gate / up,
    SiLU MLPs with the SwiGLU epilogue in the matmul (`fuse_projections`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(fuse, bool):
        raise TypeError(f"fuse must be a bool, got {type(fuse).__name__}")
    skip = _skip_names(skip)
    if calibration is not None:
        calibrate_model(model, calibration, group_size, skip, zero_point=zero_point, fmt=fmt, act_order=act_order,
                        damp=damp, true_sequential=true_sequential)
    elif act_order:
        raise ValueError("act_order=True needs calibration (GPTQ); round-to-nearest has no column order")
    targets = [(name, module) for name, module in model.named_modules()
               if name and isinstance(module, nn.Linear) and not _skipped(name, skip)]
    for name, module in targets:
        _replace(model, name, W4A16Linear.from_linear(module, group_size, zero_point=zero_point, fmt=fmt))
    return fuse_projections(model) if fuse else model


def _has_children(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Module) for name in names)


def _concat_bias(linears: list[W4A16Linear]) -> Optional[torch.Tensor]:
    """The biases of `linears` end to end, zeros standing in for a missing one (adding 0 is exact); None if none."""
    present = [m.bias for m in linears if m.bias is not None]
    if not present:
        return None
    return torch.cat([present[0].new_zeros(m.out_features) if m.bias is None else m.bias for m in linears])


def _fuse_group(model: nn.Module, name: str, module: nn.Module, group: tuple[str, ...]) -> Optional[str]:
    """Fuse `group` (QKV or GATE_UP) of `module` (at `name` in `model`); the reason it stays unfused, or None
    (fused, or nothing of it quantized)."""
    linears = [getattr(module, child) for child in group]
    if not any(isinstance(m, W4A16Linear) for m in linears):
        return None
    if not all(isinstance(m, W4A16Linear) for m in linears):
        return f"{', '.join(group)} are not all W4A16Linear"
    problem = qkv_layout_problem(module) if group == QKV else gated_mlp_problem(module)
    if problem is None and group == GATE_UP and not name:
        problem = "the MLP is the model itself, which cannot be replaced in place"
    if problem is not None:
        return problem
    try:
        weight = concat_weights([m.quantized_weight for m in linears])
    except ValueError as error:  # formats, group sizes or act-order permutations that differ
        return str(error)
    bias = _concat_bias(linears)
    if group == QKV:
        head = FusedQKVProjection(W4A16Linear(weight, bias), tuple(m.out_features for m in linears))
        module.q_proj, module.k_proj, module.v_proj = head, HandedOffProjection(head, 0), HandedOffProjection(head, 1)
    else:
        # SiLU MLPs whose gate / up rows pair in blocks run the matmul's SwiGLU epilogue; others act on its output
        swiglu = is_silu(module.act_fn) and weight.shape[0] % (2 * GATE_UP_BLOCK) == 0
        if swiglu:
            weight, bias = interleave_gate_up(weight, bias)
        _replace(model, name, GateUpMLP(W4A16Linear(weight, bias), module.down_proj, module.act_fn, swiglu=swiglu))
    return None


def fuse_projections(model: nn.Module) -> nn.Module:
    """Run the 4-bit projections of `model` that read the same input as one matmul, in place; returns `model`.
    Each attention's ``q_proj``, ``k_proj``, ``v_proj`` become one `W4A16Linear` (`fusion.FusedQKVProjection`
    and `fusion.HandedOffProjection`), each gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) a
    `fusion.GateUpMLP`, with the matmul's SwiGLU epilogue where act_fn is SiLU and gate / up have a multiple of
    GATE_UP_BLOCK rows. The fused weight holds the separate ones' rows, so the products are the same; only the
    SwiGLU epilogue rounds differently (once, from fp32, where the model rounds gate, up, the activation and the
    product). Modules whose forward is not recognised, or whose projections are not all `W4A16Linear` agreeing
    on format, group size and act-order permutation, stay as they are, with the reason logged."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    unfused = collections.Counter()
    for name, module in list(model.named_modules()):
        if _has_children(module, QKV):
            reason = _fuse_group(model, name, module, QKV)
        elif _has_children(module, GATE_UP + ("down_proj",)) and hasattr(module, "act_fn"):
            reason = _fuse_group(model, name, module, GATE_UP)
        else:
            continue
        if reason is not None:
            unfused[type(module).__name__, reason] += 1
    for (cls, reason), count in unfused.items():
        logger.warning("w4a16: %d %s module(s) left unfused: %s", count, cls, reason)
    return model


class _Stop(Exception):
    """Raised by the last decoder layer's stand-in forward, to end a capturing pass there."""


def _next_inputs(out, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A decoder layer's call with its hidden states replaced by the layer's output (positional or keyword)."""
    hidden = out[0] if isinstance(out, tuple) else out
    if args:
        return (hidden,) + args[1:], kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the longest ``nn.ModuleList`` whose items share one class."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0
             and len({type(x) for x in m}) == 1]
    if not lists:
        raise ValueError("model has no nn.ModuleList of decoder layers; quantize it with quantize_model instead")
    return max(lists, key=len)


def _shared_inputs(layer: nn.Module, linears: dict[str, nn.Linear]) -> dict[str, str]:
    """For each of `linears` (by name below `layer`), the name of the one whose input it reads: q / k / v and
    gate / up of a recognised attention or MLP read one tensor, so they share one Hessian (one pass of x^T x,
    and equal act-order permutations, which `fuse_projections` needs)."""
    reads = {name: name for name in linears}
    for prefix, module in layer.named_modules():
        for group, problem in ((QKV, qkv_layout_problem), (GATE_UP, gated_mlp_problem)):
            names = [f"{prefix}.{child}" if prefix else child for child in group]
            if all(name in linears for name in names) and problem(module) is None:
                reads.update({name: names[0] for name in names})
    return reads


def calibrate_model(model: nn.Module, calibration: Iterable, group_size: int = 128, skip: Iterable[str] = ("lm_head",),
                    *, zero_point: bool = False, fmt: str = "int4", act_order: bool = False,
                    damp: float = 0.01, true_sequential: bool = True) -> nn.Module:
    """GPTQ for every ``nn.Linear`` inside the model's decoder layers whose name does not match `skip`, in place;
    returns `model`. `calibration`: model inputs (token-id tensors ``[batch, seq]`` or dicts of keyword
    arguments), run once to record each decoder layer's call; each layer then runs on the stored activations
    with its own keyword arguments, its Hessians are collected, its linears quantized, and it runs again with
    all of them quantized to feed the next layer. With `true_sequential` a layer's linears are quantized in
    stages, one per input they read (q / k / v, o, gate / up, down, in module order), each stage's Hessians
    collected by a pass of the layer whose earlier stages are already quantized, so that a linear compensates
    the errors of the ones before it, as the next layer does for this one; without it one pass of the float
    layer serves every linear. Deterministic: no randomness is involved. Linears outside the decoder layers
    (``lm_head``) are left as they are."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    skip = _skip_names(skip)
    layers = _decoder_layers(model)
    captured = _layer_calls(model, layers, calibration)

    prefix = {layer: name for name, layer in model.named_modules()}
    inputs = [calls[0] for calls in captured]  # layer 0's calls, with the embeddings as hidden states
    for index, layer in enumerate(layers):
        if index:  # this layer's own keyword arguments (masks, rotary embeddings), the last layer's outputs
            inputs = [_next_inputs(out, calls[index][0], calls[index][1]) for out, calls in zip(outputs, captured)]
        linears = {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)
                   and not _skipped(f"{prefix[layer]}.{name}", skip)}
        reads = _shared_inputs(layer, linears)
        readers = [name for name in linears if reads[name] == name]  # one per distinct input, in module order
        for stage in ([[name] for name in readers] if true_sequential else [readers]):
            hessians = _hessians(layer, {name: linears[name] for name in stage}, inputs)
            for name, m in linears.items():
                if reads[name] in hessians:
                    qw = gptq_quantize(m.weight, hessians[reads[name]], group_size=group_size, zero_point=zero_point,
                                       fmt=fmt, act_order=act_order, damp=damp)
                    _replace(layer, name, W4A16Linear(qw, m.bias))
        with torch.no_grad():  # the next layer sees this one's quantized outputs
            outputs = [layer(*args, **kwargs) for args, kwargs in inputs]
    return model


def _hessians(layer: nn.Module, readers: dict[str, nn.Linear],
              inputs: list[tuple[tuple, dict]]) -> dict[str, torch.Tensor]:
    """``sum x^T x`` (float64) over the inputs of each of `readers` (linears of `layer`, by name) while `layer` runs
    on every call of `inputs`."""
    hessians = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64, device=m.weight.device)
                for name, m in readers.items()}

    def accumulate(name):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            hessians[name] += x.t() @ x
        return hook

    hooks = [m.register_forward_pre_hook(accumulate(name)) for name, m in readers.items()]
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                layer(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return hessians


def _layer_calls(model: nn.Module, layers: nn.ModuleList, calibration: Iterable) -> list[list[tuple[tuple, dict]]]:
    """For each calibration batch, every decoder layer's call ``(args, kwargs)`` as the model makes it: each
    layer gets its own keyword arguments (Gemma 3 gives sliding-window and full-attention layers different masks
    and rotary embeddings). The layers do not run: while capturing, each one's forward records its call and
    hands its hidden states on unchanged, and the pass stops at the last layer. Only layer 0's hidden states
    are real; `calibrate_model` replaces the others with the previous layer's outputs."""
    batches: list[list[tuple[tuple, dict]]] = []

    def stand_in(index):
        def forward(*args, **kwargs):
            batches[-1].append((args, kwargs))
            if index == len(layers) - 1:
                raise _Stop
            return args[0] if args else kwargs["hidden_states"]
        return forward

    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    own = [layer.__dict__.get("forward") for layer in layers]  # a forward set on the instance, put back after
    for index, layer in enumerate(layers):
        layer.forward = stand_in(index)  # an instance attribute: nn.Module.__call__ runs it, hooks included
    try:
        with torch.no_grad():
            for batch in calibration:
                batches.append([])
                with contextlib.suppress(_Stop):
                    if isinstance(batch, dict):
                        model(**batch, **no_cache)
                    else:
                        model(batch, **no_cache)
                if len(batches[-1]) != len(layers):
                    raise ValueError(f"a calibration pass called {len(batches[-1])} of the model's {len(layers)} "
                                     "decoder layers; calibrate_model needs every layer called once per pass")
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
    if not batches:
        raise ValueError("calibration yielded no inputs")
    return batches
