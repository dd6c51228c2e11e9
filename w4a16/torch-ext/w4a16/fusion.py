"""Projections that read the same input, run as one 4-bit matmul: an attention's q / k / v and a gated MLP's
gate / up, their weights concatenated along N (`concat_weights`).

Exact by construction: quantization is per output row (round-to-nearest groups run along K within a row; GPTQ
updates a row from that row's own errors and the Hessian of the input, which siblings share), so the fused weight
holds the separate weights' packed rows, scales and zero points unchanged, and each output column is the same dot
product as before.

The modules that replace the model's keep its own code running unchanged:

- `FusedQKVProjection` replaces ``q_proj``: it runs the fused matmul, returns the q columns and hands the k and
  v columns to the `HandedOffProjection` modules that replace ``k_proj`` and ``v_proj``, which return them when
  called with the same input tensor and raise otherwise. The handoff is Python state set and cleared within one
  attention call, with no host sync and no data-dependent branch: the checks compare tensor identity and None,
  which torch.compile resolves while tracing (a failing check is an error there too), and a CUDA graph records
  just the one matmul, the slices being views.
- `GateUpMLP` replaces a whole MLP whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, keeping
  the model's ``act_fn`` and ``down_proj``. Where ``act_fn`` is SiLU the fused rows are interleaved
  (`interleave_gate_up`) and the matmul's SwiGLU epilogue computes silu(gate) * up from its fp32 accumulators,
  so the gate / up output never reaches memory; that rounds once where the model rounded gate, up, the activation
  and the product to its dtype, so the logits agree to that rounding rather than bit for bit.

Layouts are recognised from the module's forward code (`qkv_layout_problem`, `gated_mlp_problem`): anything else
is left unfused.
"""

from __future__ import annotations

import dis
import inspect
from typing import Optional, Sequence

import torch
from torch import nn

from .formats import GATE_UP_BLOCK, PAD_N, QuantizedWeight, check_swiglu_rows, pad_group_params, round_up, take_rows
from .reference import join_gate_up

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def concat_weights(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose output rows are those of `weights`, in order (concatenated along N). They must agree on
    everything but N: in_features, format, group size, dtypes, zero points / minima or none, and the act-order
    `perm`."""
    weights = list(weights)
    if not weights or not all(isinstance(w, QuantizedWeight) for w in weights):
        raise TypeError("weights must be a non-empty sequence of QuantizedWeight")
    first = weights[0]
    for i, w in enumerate(weights[1:], 1):
        problem = (
            "in_features" if w.shape[1] != first.shape[1] else
            "fmt" if w.fmt != first.fmt else
            "group_size" if w.group_size != first.group_size else
            "dtype" if w.dtype != first.dtype or w.scales.dtype != first.scales.dtype else
            "device" if w.device != first.device else
            "zero points" if (w.zeros is None) != (first.zeros is None) else
            "minima" if (w.mins is None) != (first.mins is None) else
            "codebook" if w.codebook is not None and not torch.equal(w.codebook, first.codebook) else
            "perm" if (w.perm is None) != (first.perm is None) or (
                w.perm is not None and not torch.equal(w.perm, first.perm)) else None)
        if problem is not None:
            raise ValueError(f"weights[{i}] differs from weights[0] in its {problem}: only weights that agree on "
                             f"all but out_features concatenate")
    n, k = sum(w.shape[0] for w in weights), first.shape[1]
    qweight = first.qweight.new_zeros(round_up(n, PAD_N), first.qweight.shape[1])
    qweight[:n] = torch.cat([w.qweight[: w.shape[0]] for w in weights])  # a packed row is one output row

    def columns(name: str) -> torch.Tensor:
        values = torch.cat([getattr(w, name)[:, : w.shape[0]] for w in weights], dim=1)
        return pad_group_params(values, (n, k), first.group_size)

    return QuantizedWeight(qweight=qweight, scales=columns("scales"),
                           zeros=None if first.zeros is None else columns("zeros"),
                           mins=None if first.mins is None else columns("mins"), codebook=first.codebook,
                           perm=first.perm, shape=(n, k), group_size=first.group_size, fmt=first.fmt,
                           dtype=first.dtype)


def interleave_gate_up(gate_up: QuantizedWeight, bias: Optional[torch.Tensor] = None):
    """`gate_up` (``concat_weights([gate, up])``: I gate rows, then I up rows, I a multiple of GATE_UP_BLOCK) and its
    bias ``[2 I]`` (or None) with the rows in the SwiGLU layout of `ops.swiglu_matmul`: blocks of GATE_UP_BLOCK gate
    rows, then the same up rows (`reference.join_gate_up`). Packed rows, scales and zero points (minima) move
    unchanged."""
    if not isinstance(gate_up, QuantizedWeight):
        raise TypeError(f"gate_up must be a QuantizedWeight, got {type(gate_up).__name__}")
    n, k = gate_up.shape
    check_swiglu_rows(n)
    order = join_gate_up(*torch.arange(n, device=gate_up.device).chunk(2))
    weight = take_rows(gate_up, order)
    return weight, None if bias is None else bias[order.to(bias.device)]


def is_silu(act_fn) -> bool:
    """Whether `act_fn` is SiLU: ``nn.SiLU`` (transformers' ``ACT2FN["swish"]``), ``F.silu``, or transformers'
    ``SiLUActivation`` (``ACT2FN["silu"]``, recognised by name: this package does not import transformers)."""
    cls = type(act_fn)
    return (isinstance(act_fn, nn.SiLU) or act_fn is nn.functional.silu
            or (cls.__name__ == "SiLUActivation" and cls.__module__ == "transformers.activations"))


class _Handoff:
    """The k and v columns of the latest fused matmul and the input they were computed from, until taken."""

    def __init__(self) -> None:
        self.source: Optional[torch.Tensor] = None
        self.outputs: list[Optional[torch.Tensor]] = [None, None]


class FusedQKVProjection(nn.Module):
    """In place of ``q_proj``: `qkv` (one matmul for q, k and v) returns q and hands k, v to the modules that
    replace ``k_proj`` and ``v_proj`` (`HandedOffProjection`)."""

    def __init__(self, qkv: nn.Module, out_features: tuple[int, int, int]) -> None:
        super().__init__()
        self.qkv = qkv
        self.split_sizes = tuple(out_features)
        self.in_features, self.out_features = qkv.in_features, out_features[0]
        self.handoff = _Handoff()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        self.handoff.source = x
        self.handoff.outputs = [k, v]
        return q

    def extra_repr(self) -> str:
        return f"q, k, v out_features={self.split_sizes}"


class HandedOffProjection(nn.Module):
    """In place of ``k_proj`` (`index` 0) or ``v_proj`` (1): the columns `FusedQKVProjection` computed for the
    same input tensor. Called in any other way (another input, before ``q_proj``, twice) it raises."""

    def __init__(self, source: FusedQKVProjection, index: int) -> None:
        super().__init__()
        self.handoff = source.handoff  # shared state, not a submodule: the fused weight stays under q_proj only
        self.index = index
        self.in_features, self.out_features = source.in_features, source.split_sizes[1 + index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        handoff = self.handoff
        out = handoff.outputs[self.index]
        if out is None or handoff.source is not x:
            raise RuntimeError(f"{QKV[1 + self.index]} is fused with q_proj: it must be called after q_proj, once, "
                               f"on the same input tensor (quantize_model(..., fuse=False) keeps it separate)")
        handoff.outputs[self.index] = None
        if handoff.outputs[0] is None and handoff.outputs[1] is None:  # the input is not held past the attention
            handoff.source = None
        return out

    def extra_repr(self) -> str:
        return f"{QKV[1 + self.index]} from q_proj's fused matmul, out_features={self.out_features}"


class GateUpMLP(nn.Module):
    """``down_proj(act_fn(gate) * up)`` with gate and up from one matmul `gate_up` (a `W4A16Linear`): with `swiglu`
    (act_fn SiLU) its rows are in the SwiGLU layout (`interleave_gate_up`) and it runs ``gate_up.swiglu``, the
    matmul with the SwiGLU epilogue; else gate rows, then up rows, and `act_and_mul` on its output. The layout is
    the module's extra state in the state_dict, so a state_dict of either layout loads right."""

    def __init__(self, gate_up: nn.Module, down_proj: nn.Module, act_fn, swiglu: bool = False) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down_proj = down_proj
        self.act_fn = act_fn
        self._set_layout(swiglu)

    def _set_layout(self, swiglu: bool) -> None:
        if not isinstance(swiglu, bool):
            raise TypeError(f"swiglu must be a bool, got {type(swiglu).__name__}")
        if swiglu:
            if not is_silu(self.act_fn):
                raise ValueError(f"swiglu=True needs a SiLU act_fn, got {type(self.act_fn).__name__}")
            check_swiglu_rows(self.gate_up.out_features)
        self.swiglu = swiglu

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act_fn(gate) * up`` from the fused matmul's output (gate rows, then up rows)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down_proj(self.gate_up.swiglu(x))
        return self.down_proj(self.act_and_mul(self.gate_up(x)))

    def get_extra_state(self) -> torch.Tensor:
        """The row layout of `gate_up`: GATE_UP_BLOCK (the SwiGLU layout) or 0 (gate rows, then up rows)."""
        return torch.tensor(GATE_UP_BLOCK if self.swiglu else 0)

    def set_extra_state(self, state) -> None:
        block = int(state)
        if block not in (0, GATE_UP_BLOCK):
            raise ValueError(f"the state_dict's gate_up layout must be 0 or {GATE_UP_BLOCK} (rows per block), "
                             f"got {block}")
        self._set_layout(block == GATE_UP_BLOCK)

    def extra_repr(self) -> str:
        return f"gate / up rows: {'SwiGLU layout, the epilogue in the matmul' if self.swiglu else 'gate, then up'}"


def _gated_mlp_forward(self, x):  # the forward GateUpMLP stands in for, compared with a model's by bytecode
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


# The flags that change how a function runs (compiler flags such as `from __future__ import annotations` do not).
_RUN_FLAGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR | inspect.CO_COROUTINE | \
    inspect.CO_ASYNC_GENERATOR


def _code_key(function) -> tuple:
    code = function.__code__  # local variable names left out: they do not change what runs
    return (code.co_code, code.co_names, code.co_consts, code.co_argcount, code.co_kwonlyargcount,
            code.co_flags & _RUN_FLAGS)


_GATED_MLP_KEY = _code_key(_gated_mlp_forward)


def gated_mlp_problem(module: nn.Module) -> Optional[str]:
    """Why `module` cannot become a `GateUpMLP`, or None: its forward must compile to exactly
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, with gate and up of the same size."""
    forward = type(module).forward
    if not hasattr(forward, "__code__") or _code_key(forward) != _GATED_MLP_KEY:
        return f"{type(module).__name__}.forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    if module.gate_proj.out_features != module.up_proj.out_features:
        return "gate_proj and up_proj differ in out_features"
    return None


def qkv_layout_problem(module: nn.Module) -> Optional[str]:
    """Why `module`'s q_proj, k_proj and v_proj cannot be fused, or None: its forward must call each once, q_proj
    first, on its own first argument, which it never reassigns (so all three read the same tensor)."""
    name = type(module).__name__
    forward = type(module).forward
    code = getattr(forward, "__code__", None)
    if code is None or code.co_argcount < 2:
        return f"{name}.forward takes no input argument"
    arg = code.co_varnames[1]
    if arg in code.co_cellvars:
        return f"{name}.forward captures {arg} in a closure"
    ops = list(dis.get_instructions(code))
    calls = []
    for i, op in enumerate(ops):
        names = op.argval if isinstance(op.argval, tuple) else (op.argval,)
        if op.opname.startswith(("STORE_FAST", "DELETE_FAST")) and arg in names:
            return f"{name}.forward reassigns {arg}"
        if op.opname in ("LOAD_ATTR", "LOAD_METHOD") and op.argval in QKV:
            rest = [o for o in ops[i + 1: i + 4] if o.opname != "PRECALL"]
            on_arg = (len(rest) >= 2 and rest[0].opname.startswith("LOAD_FAST") and rest[0].argval == arg
                      and rest[1].opname == "CALL" and rest[1].arg == 1)
            if not on_arg:
                return f"{name}.forward uses {op.argval} other than as {op.argval}({arg})"
            calls.append(op.argval)
    if tuple(calls) != QKV:
        return f"{name}.forward calls {', '.join(calls) or 'none of q_proj, k_proj, v_proj'}, not q, k, v once each"
    return None
