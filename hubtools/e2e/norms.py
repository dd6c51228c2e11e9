"""Swap a transformers model's RMSNorm forwards for the rmsnorm kernel's layer with `kernels.kernelize`."""

from __future__ import annotations

import logging

import torch
from torch import nn


def kernelize_rmsnorm(model: nn.Module, layer_repository, device: torch.device | str) -> tuple[int, str]:
    """Map every module transformers tags "RMSNorm" onto `layer_repository` (a `LayerRepository` or
    `LocalLayerRepository`), in place. Returns (how many norms now run the kernel's forward, its qualified
    name); raises if any norm kept its own forward."""
    from kernels import Mode, kernelize, use_kernel_mapping

    device = torch.device(device)
    device_type = "rocm" if device.type == "cuda" and torch.version.hip else device.type
    # inherit_mapping=False: only this mapping, never a default one that would point at another hub repo.
    # kernels warns about each other hub-tagged layer (SiLU, rotary_pos_emb) that it leaves as is: silenced.
    kernels_logger = logging.getLogger("kernels")
    level = kernels_logger.level
    kernels_logger.setLevel(logging.ERROR)
    try:
        with use_kernel_mapping({"RMSNorm": {device_type: layer_repository}}, inherit_mapping=False):
            kernelize(model, mode=Mode.INFERENCE, device=device_type)
    finally:
        kernels_logger.setLevel(level)
    norms = [m for m in model.modules() if getattr(type(m), "kernel_layer_name", None) == "RMSNorm"]
    replaced = [m.forward.__func__ for m in norms
                if getattr(m.forward, "__func__", None) not in (None, type(m).forward)]
    if not norms or len(replaced) != len(norms):
        raise RuntimeError(f"kernelize replaced {len(replaced)} of {len(norms)} RMSNorm forwards "
                           "(transformers without Hub-kernel hooks for kernels 0.17?)")
    return len(replaced), ", ".join(sorted({f"{f.__module__}.{f.__qualname__}" for f in replaced}))
