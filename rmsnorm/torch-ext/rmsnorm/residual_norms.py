"""Residual adds fused with the RMSNorm that follows them, through a whole `transformers` decoder
(`fuse_residual_norms`).

A pre-norm decoder layer computes ``residual + attn_out``, its post-attention norm, ``residual + mlp_out``, and
then the next layer's input norm of that sum: two adds and two norms, each reading and writing the hidden states
once more. `fused_add_rms_norm` computes an add and the norm of its result in one pass. After
`fuse_residual_norms(model)`, every add runs fused with the norm after it:

- within a layer, ``residual + attn_out`` with ``post_attention_layernorm`` (Gemma 2 / 3:
  ``residual + post_attention_layernorm(attn_out)`` with ``pre_feedforward_layernorm``);
- across layers, ``residual + mlp_out`` (Gemma 2 / 3: ``residual + post_feedforward_layernorm(mlp_out)``) with
  the next layer's ``input_layernorm``, and in the last layer with the model's final ``norm``. The layer still
  returns the sum, the true hidden states, and leaves the normalized output in a `Handoff` for that norm, which
  uses it only when handed that very tensor, unchanged; otherwise it computes the norm itself.

Why a handoff between the stock loop's calls rather than a new loop over the layers: the loop
(`LlamaModel.forward` and its copies) differs between models and transformers versions (masks and position
embeddings per layer type, output capture, ``num_hidden_layers`` slicing) and would have to be rewritten for each;
the decoder layers' forwards are few, and recognised exactly from their code (`layer_layout`).

Why the producer returns the sum and hands over the normalized output, not the reverse (returning ``mlp_out``
and handing over the residual): whatever sees a layer's output between layers (transformers' hidden-states
capture, a user's hook, a loop that stops early) sees the true hidden states, and a consumer that does not take
the handoff (it was given another tensor, the loop skipped a layer, kernelize replaced the final norm's forward)
is still right: only the saving is lost. A wrong pairing cannot happen: a handoff belongs to one consumer norm,
holds the normalized output of exactly the tensor it names (with that norm's weight, eps and offset), and is used
only for that tensor object, and refused when the tensor may have been written in place since: its version
counter moved, or, where there is no counter to read (inference tensors; torch.compile while tracing), a hook that
may write ran between producer and consumer.

All of it is Python state, set and cleared within one forward (a handoff whose consumer did not run is overwritten
by the next), with no host sync and no data-dependent branch (the checks compare tensor identity, version
counters, dtypes and hook tables): a CUDA graph records just the fused kernels, and torch.compile resolves the
checks while tracing.
"""

from __future__ import annotations

import inspect
from types import MethodType
from typing import Optional

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from . import layers, ops

# The flags that change how a function runs (compiler flags such as `from __future__ import annotations` do not).
_RUN_FLAGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR | inspect.CO_COROUTINE | \
    inspect.CO_ASYNC_GENERATOR


def _code_key(function) -> Optional[tuple]:
    """What running `function` does: its bytecode, the names and constants it uses, its parameters' names (callers
    pass them by keyword) and defaults. Local variable names are left out: they do not change what runs."""
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    n_params = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS) + \
        bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return (code.co_code, code.co_names, code.co_consts, code.co_flags & _RUN_FLAGS, code.co_varnames[:n_params],
            function.__defaults__, function.__kwdefaults__)


# --- the norms: what each computes, recognised from its code ------------------------------------------------

# transformers' norm forwards, compared with a model's by bytecode (never called): LlamaRMSNorm's (and its copies
# in Mistral, Qwen2, Qwen3...) is the kernel with offset 0.0, GemmaRMSNorm's (Gemma, Gemma 2, Gemma 3) with 1.0.
def _llama_norm_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _gemma_norm_forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)


def _gemma_norm_norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


_LLAMA_NORM = ("variance_epsilon", 0.0)  # (the attribute holding eps, the kernel's offset)
_ZERO_CENTERED_NORM = ("eps", 1.0)
_KERNEL_FORWARDS = {_code_key(layers.RMSNorm.forward): _LLAMA_NORM,
                    _code_key(layers.RMSNormZeroCentered.forward): _ZERO_CENTERED_NORM}
_LLAMA_NORM_KEY = _code_key(_llama_norm_forward)
_GEMMA_NORM_KEYS = (_code_key(_gemma_norm_forward), _code_key(_gemma_norm_norm))


class Norm:
    """An RMSNorm module of the model, run as the kernel: its own `weight` and eps (read at each call, so loading
    a state_dict later counts) with the offset its code computes."""

    def __init__(self, module: nn.Module, eps_attribute: str, offset: float) -> None:
        self.module, self.eps_attribute, self.offset = module, eps_attribute, offset

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(hidden_states, self.module.weight, float(getattr(self.module, self.eps_attribute)),
                            self.offset)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x), in one pass where x and residual share a dtype. Where they do
        not (autocast: bf16 sublayer outputs on an fp32 residual stream) the add promotes, as in the model, and the
        norm runs on its own."""
        if x.dtype != residual.dtype:
            total = residual + x
            return self(total), total
        return ops.fused_add_rms_norm(x, residual, self.module.weight,
                                      float(getattr(self.module, self.eps_attribute)), self.offset)


def recognise_norm(module: nn.Module, name: str) -> Norm:
    """`module` as a `Norm`, or ValueError naming it: its forward must be transformers' LlamaRMSNorm or
    GemmaRMSNorm code (or a copy), or one of this kernel's layers put there by `kernels.kernelize` (any loaded copy
    of this package), with a 1-D weight."""
    cls = type(module)
    if "forward" in vars(module):  # replaced on the instance, as kernelize does
        kind = _KERNEL_FORWARDS.get(_code_key(getattr(module.forward, "__func__", None)))
        if kind is None:
            raise ValueError(f"{name} ({cls.__name__}) runs a forward replaced by something other than this kernel's "
                             f"layers ({getattr(module.forward, '__qualname__', type(module.forward).__name__)})")
    elif _code_key(cls.forward) == _LLAMA_NORM_KEY:
        kind = _LLAMA_NORM
    elif (_code_key(cls.forward), _code_key(getattr(cls, "_norm", None))) == _GEMMA_NORM_KEYS:
        kind = _ZERO_CENTERED_NORM
    else:
        raise ValueError(f"{name} ({cls.__name__}) is not an RMSNorm this knows: its forward is neither "
                         f"LlamaRMSNorm's (weight * normed) nor GemmaRMSNorm's ((1 + weight) * normed)")
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise ValueError(f"{name} ({cls.__name__}) has no 1-D weight")
    return Norm(module, *kind)


# --- the handoff between a layer and the norm after it ------------------------------------------------------

def _version(t: torch.Tensor) -> Optional[int]:
    """`t`'s version counter (how many in-place writes it has had), or None where there is none to read: an
    inference tensor (made under torch.inference_mode) counts none, and torch.compile cannot trace the counter of
    an op's output (it becomes a data-dependent value) nor `is_inference`."""
    if torch.compiler.is_compiling() or t.is_inference():
        return None
    return t._version


class Handoff:
    """The output of `norm` for the tensor `producer` (a decoder layer) returned, computed by that layer's last
    fused add, until `consumer` (the next layer, or the final norm module) takes it."""

    def __init__(self, norm: Norm, producer: nn.Module, consumer: nn.Module) -> None:
        self.norm, self.producer, self.consumer = norm, producer, consumer
        self.source: Optional[torch.Tensor] = None
        self.normed: Optional[torch.Tensor] = None
        self.version: Optional[int] = None

    def give(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x``, the producer's output; `norm` of it is kept for the consumer."""
        self.normed, self.source = self.norm.add(x, residual)
        self.version = _version(self.source)
        return self.source

    def take(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        """`norm` of `hidden_states` if it is the tensor given, unchanged since, else None; the handoff is emptied
        either way (nothing is held past the forward)."""
        normed = self.normed if hidden_states is self.source and self._unchanged(hidden_states) else None
        self.source = self.normed = self.version = None
        return normed

    def _unchanged(self, hidden_states: torch.Tensor) -> bool:
        if self.version is not None:
            return hidden_states._version == self.version
        # No version to compare: between the producer's forward and the consumer's only the model's loop and hooks
        # run, and transformers' loops write nothing in place, so no hook that may write may have run.
        return not any(map(_may_write, (self.producer._forward_hooks, self.consumer._forward_pre_hooks,
                                        module_hooks._global_forward_hooks, module_hooks._global_forward_pre_hooks)))


def _may_write(hooks: dict) -> bool:
    """Whether a hook table holds a hook that may write its module's output in place: any but transformers' output
    capture (output_hidden_states, installed on the decoder layers for good once asked for), which only records."""
    return any(getattr(hook, "__module__", None) != "transformers.utils.output_capturing" for hook in hooks.values())


class LayerNorms:
    """What a rewired decoder layer reads: the handoff its input norm comes from (None for the first layer), the
    norm its attention residual add is fused with, and the handoff its MLP residual add fills."""

    def __init__(self, incoming: Optional[Handoff], mid: Norm, outgoing: Handoff) -> None:
        self.incoming, self.mid, self.outgoing = incoming, mid, outgoing

    def input_norm(self, layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = None if self.incoming is None else self.incoming.take(hidden_states)
        return layer.input_layernorm(hidden_states) if normed is None else normed


# --- the decoder layers: the forwards recognised, and the fused forwards that replace them -------------------

# transformers' decoder-layer forwards, compared with a model's by bytecode (never called). Pre-norm: Llama, Mistral,
# Qwen2, Qwen3, Gemma. Sandwich (norms on both sides of each sublayer): Gemma 2, Gemma 3.
def _pre_norm_layer(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states


def _sandwich_layer(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                    past_key_values=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        position_embeddings=position_embeddings,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        **kwargs,
    )
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.pre_feedforward_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = self.post_feedforward_layernorm(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states


def fused_pre_norm_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    """`_pre_norm_layer` with ``residual + attn_out`` fused with post_attention_layernorm and ``residual + mlp_out``
    with the next norm (`LayerNorms`); the same signature, so the model's loop calls it unchanged."""
    norms = self.residual_norms
    residual = hidden_states
    hidden_states, _ = self.self_attn(
        hidden_states=norms.input_norm(self, hidden_states),
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states, residual = norms.mid.add(hidden_states, residual)
    return norms.outgoing.give(self.mlp(hidden_states), residual)


def fused_sandwich_forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                           past_key_values=None, **kwargs):
    """`_sandwich_layer` with ``residual + post_attention_layernorm(attn_out)`` fused with pre_feedforward_layernorm
    and ``residual + post_feedforward_layernorm(mlp_out)`` with the next norm (`LayerNorms`)."""
    norms = self.residual_norms
    residual = hidden_states
    hidden_states, _ = self.self_attn(
        hidden_states=norms.input_norm(self, hidden_states),
        position_embeddings=position_embeddings,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        **kwargs,
    )
    hidden_states, residual = norms.mid.add(self.post_attention_layernorm(hidden_states), residual)
    return norms.outgoing.give(self.post_feedforward_layernorm(self.mlp(hidden_states)), residual)


def fused_final_norm_forward(self, hidden_states):
    """The model's final norm: the output the last layer handed off for `hidden_states`, else the kernel's norm."""
    normed = self.residual_norms.take(hidden_states)
    return self.residual_norms.norm(hidden_states) if normed is None else normed


# layout -> (the fused forward, the norm its attention residual add is fused with)
LAYOUTS = {
    _code_key(_pre_norm_layer): (fused_pre_norm_forward, "post_attention_layernorm"),
    _code_key(_sandwich_layer): (fused_sandwich_forward, "pre_feedforward_layernorm"),
}
_FUSED_FORWARDS = (fused_pre_norm_forward, fused_sandwich_forward, fused_final_norm_forward)


def layer_layout(layer: nn.Module, name: str) -> tuple:
    """(the fused forward, the name of its middle norm) for `layer`, or ValueError naming it and its class: its
    class's forward must compile to exactly one of the recognised layouts, and nothing may have replaced it on the
    instance (accelerate's hooks do: offloaded models are not supported)."""
    cls = type(layer)
    if "forward" in vars(layer):
        if getattr(layer.forward, "__func__", None) in _FUSED_FORWARDS:
            raise ValueError(f"{name} ({cls.__name__}) is already rewired by fuse_residual_norms")
        raise ValueError(f"{name} ({cls.__name__}) has its forward replaced on the instance "
                         f"({getattr(layer.forward, '__qualname__', type(layer.forward).__name__)})")
    layout = LAYOUTS.get(_code_key(cls.forward))
    if layout is None:
        raise ValueError(f"{name} ({cls.__name__}) is not a decoder layer fuse_residual_norms knows: its forward is "
                         "neither the pre-norm layer of Llama / Mistral / Qwen2 / Qwen3 / Gemma nor the sandwich layer "
                         "of Gemma 2 / Gemma 3 as transformers writes them")
    return layout


def _decoder(model: nn.Module) -> tuple[str, nn.Module]:
    """The one module of `model` (itself included) holding the decoder layers, ``layers`` (an nn.ModuleList), and
    the final ``norm``."""
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(getattr(m, "layers", None), nn.ModuleList)
             and isinstance(getattr(m, "norm", None), nn.Module)]
    if len(found) != 1:
        where = ", ".join(name or "the model itself" for name, _ in found) or "none"
        raise ValueError(f"model must hold exactly one decoder (a module with `layers`, an nn.ModuleList, and a final "
                         f"`norm`); found {len(found)}: {where}")
    return found[0]


def fuse_residual_norms(model: nn.Module) -> int:
    """Rewire the decoder of a `transformers` causal LM (or its base model) in place so that every residual add
    runs fused with the RMSNorm after it (see the module docstring); returns how many adds are fused (two per
    layer). Plain forwards, `generate`, CUDA-graph capture and torch.compile work as before.

    Everything is checked before anything changes: each decoder layer must be a layout this recognises (Llama,
    Mistral, Qwen2, Qwen3 and Gemma's pre-norm layer; Gemma 2 and Gemma 3's sandwich layer), each norm it fuses a
    recognised RMSNorm, stock or already kernelized (`recognise_norm`); else ValueError naming the module and its
    class. The fused norms' modules are no longer called (their hooks do not run), the first layer's input norm and
    Gemma's post-sublayer norms still are. Call it after `kernels.kernelize`: kernelizing afterwards replaces the
    final norm's forward, which then computes its norm again (right, but slower)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    prefix, decoder = _decoder(model)
    prefix = f"{prefix}." if prefix else ""
    decoder_layers, final = list(decoder.layers), decoder.norm
    if not decoder_layers:
        raise ValueError(f"model's decoder ({prefix}layers) has no layers")
    if len({id(m) for m in decoder_layers} | {id(final)}) != len(decoder_layers) + 1:
        raise ValueError(f"model's decoder ({prefix}layers) holds a module twice: a handoff needs one place per layer")
    layouts, mids, inputs = [], [], []
    for i, layer in enumerate(decoder_layers):
        name = f"{prefix}layers.{i}"
        layouts.append(layer_layout(layer, name))
        mids.append(recognise_norm(getattr(layer, layouts[-1][1]), f"{name}.{layouts[-1][1]}"))
        if i > 0:
            inputs.append(recognise_norm(layer.input_layernorm, f"{name}.input_layernorm"))
    if "forward" in vars(final) and getattr(final.forward, "__func__", None) is fused_final_norm_forward:
        raise ValueError(f"{prefix}norm ({type(final).__name__}) is already rewired by fuse_residual_norms")
    inputs.append(recognise_norm(final, f"{prefix}norm"))
    consumers = decoder_layers[1:] + [final]
    handoffs = [Handoff(norm, producer, consumer)
                for norm, producer, consumer in zip(inputs, decoder_layers, consumers)]
    for i, (layer, (forward, _)) in enumerate(zip(decoder_layers, layouts)):
        # Plain attributes, not submodules: the next layer's norm stays in the module tree (and state_dict) once.
        layer.residual_norms = LayerNorms(handoffs[i - 1] if i else None, mids[i], handoffs[i])
        layer.forward = MethodType(forward, layer)
    final.residual_norms = handoffs[-1]
    final.forward = MethodType(fused_final_norm_forward, final)
    return 2 * len(decoder_layers)
