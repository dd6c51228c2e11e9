"""Launch configs: tuned tables per layer shape and GPU (configs/*.json) and the heuristic."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
import triton

DECODE_MAX_TOKENS = 16  # up to this many tokens one 16-row tile holds them all: the decode kernels run
GEMV_MAX_TOKENS = 4  # 4-bit experts up to this many tokens: the GEMV kernels (gemv.py)
STREAM_MAX_INTERMEDIATE = 4096  # 16-bit experts of at most this intermediate size: one token on the stream kernels
PACKED_GEMV_MAX_TOKENS = 16  # the same for formats of the packed-fp16 GEMVs (`launch.packed_gemv`)
FOLD_MAX_TOKENS = 4  # up to this many tokens a one-step packed down GEMV does the combine itself (FOLD_COMBINE)
# Up to this many tokens the router logits come from `_router_gemv_kernel`, ROUTER_BLOCK_E router rows per program
# over all of H in tiles of ROUTER_GEMV_ELEMENTS products; cuBLAS took 4-6 us for these GEMVs on the H100 (run 82),
# from 64 KB of router (Mixtral-8x7B) to 3.7 MB (DeepSeek-V3).
ROUTER_GEMV_MAX_TOKENS = 4
ROUTER_BLOCK_E = 2
ROUTER_GEMV_ELEMENTS = 4096
CHUNK_TOKENS = 64  # tokens per routing chunk; the sort places one chunk per program
# 4-bit experts from this many (token, slot) pairs per expert: dequantized once into 16-bit experts (chunks of
# at most DEQUANT_CHUNK_BYTES), then the bf16 grouped kernels, instead of dequantizing in every token block's K
# loop. On the H200 the K-loop dequantization cost ~0.12 ps per weight and 64-token block over the bf16 kernels
# (run 61: Mixtral-8x7B and Qwen3-30B-A3B at T = 4096), dequantizing first ~0.7 ps per weight (2.5 bytes of
# traffic): even at ~6 blocks, ~400 pairs (docs/design/moe-dispatch.md).
DEQUANT_MIN_PAIRS = 512
# 4-bit int4 experts on Hopper from this many pairs per expert: the Gluon grouped kernel (`launch._grouped_wgmma`,
# dequantization overlapped with wgmma), WGMMA_PLAN, ahead of both paths above. On the H100 (runs 143-144,
# docs/design/moe-dispatch.md E56) it ran 1.39x the shipped path at 256 and 1024 pairs per expert on Mixtral-8x7B and
# 1.11x at 256 on Qwen3-30B-A3B, but 0.90-0.93x at 128 and less on Qwen3 (short K: 16 and 6 K-tiles a block).
WGMMA_MIN_PAIRS = 256
# ... and from half as many where both GEMMs' K (H and I) span at least this many 128-column K-tiles: a block's start,
# end and partial token tiles weigh less over a longer K. DeepSeek-V3 (56 and 16 K-tiles) ran 1.07x at 128 pairs
# per expert (run 144), Qwen3-30B-A3B (16 and 6) 0.94x.
WGMMA_LONG_K_TILES = 16
WGMMA_PLAN = {"WGMMA": {"num_stages": 3}, "BLOCK_M": 128}
DEQUANT_CHUNK_BYTES = 1 << 30
DEQUANT_BLOCK_N = 64  # weight rows per program of the dequantize kernel
# the next chunk dequantized on a second stream while the grouped kernels run the last one
# (`launch._dequantized_columns`)
DEQUANT_OVERLAP = True
CONFIG_DIR = Path(__file__).parent.parent / "configs"
logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------


def config_path(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device_name: str) -> Path:
    """configs/E=..,H=..,I=..,dtype=..,device=<gpu>.json: the layer's shape, then the GPU's name in lower case
    with dashes ("NVIDIA H200" -> nvidia-h200), so a table applies only to the GPU it was measured on."""
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    dtype_name = str(dtype).removeprefix("torch.")
    return CONFIG_DIR / f"E={num_experts},H={hidden},I={intermediate},dtype={dtype_name},device={slug}.json"


@functools.cache
def _tuned_configs(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                   device_name: str) -> dict[int, dict]:
    """{token count: config} of the layer's table for this GPU ({} without one); the file also holds its
    "device" and "measured" (provenance)."""
    path = config_path(num_experts, hidden, intermediate, dtype, device_name)
    if not path.exists():
        return {}
    return {int(tokens): config for tokens, config in json.loads(path.read_text())["tokens"].items()}


@functools.cache
def _device_name(device: torch.device) -> str | None:
    """The GPU's name; None for CPU tensors (the Triton interpreter), which take the heuristic silently."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


@functools.cache
def _note_heuristic(device_name: str, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                    decode: bool) -> None:
    """Say once per GPU, layer shape and side of the decode cut that no tuned config exists."""
    path = config_path(num_experts, hidden, intermediate, dtype, device_name)
    logger.warning("moe-dispatch: no tuned %s config for E=%d, H=%d, I=%d, %s on %s (%s configs/%s); using the "
                   "heuristic", "decode" if decode else "grouped", num_experts, hidden, intermediate, dtype,
                   device_name, "in" if path.exists() else "no", path.name)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: keep grids small


def _pow2_at_most(n: int, cap: int) -> int:
    """The smallest power of two >= n, at least 16 (tl.dot's minimum) and at most cap."""
    return max(16, min(cap, triton.next_power_of_2(n)))


def default_config(tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int,
                   device: torch.device, quantized: bool = False, packed: bool = False) -> dict:
    """Heuristic block sizes when no tuned config exists for the shape (`quantized`: 4-bit experts, whose
    BLOCK_K is the packed tile; `_for_weights`; `packed`: of a format the packed-fp16 GEMVs take)."""
    if packed:
        # Each (token, slot) pair streams its expert, so the GEMVs pay for experts picked by several pairs: against
        # the tl.dot decode kernels they won at up to 2 pairs per expert and lost at 4 (run 50: Mixtral T = 8 / 16
        # 1.25x / 0.68x; DeepSeek-V3 and Qwen3-30B-A3B, 0.5-1 pairs per expert at T = 16, 1.7x / 1.2x).
        if tokens <= PACKED_GEMV_MAX_TOKENS and 2 * tokens * top_k <= 5 * num_experts:
            # 16 rows by 8 tiles, x broadcast over the rows, a 3-stage TMA ring, 2 warps: the fastest of 12
            # candidates or within 4 % of it for both GEMVs of those three models at T = 1 and 4 (run 49,
            # docs/design/moe-dispatch.md); split-K never helped
            plan = {"BLOCK_N": 16, "BLOCK_K": 128, "TILES": 8, "num_warps": 2, "num_stages": 3, "X_BCAST": True,
                    "TMA": True, "PDL": True}
            if triton.cdiv(intermediate, 128) <= plan["TILES"]:
                # Small experts, whose down GEMV is one loop step (runs 157-162, docs/design/moe-dispatch.md E64,
                # E65, E68; H100, Qwen3-30B-A3B against this plan without the keys: 1.16x / 1.27x / 1.17x / 1.22x /
                # 1.26x at T = 1 / 2 / 4 / 8 / 16):
                # - the down grid launches once the gate/up programs pass their wait, and loads its words while
                #   that grid drains (the trigger alone lost 9 % on Mixtral, where the preload does not apply);
                # - one warp per down program (its words are one box); 8-row programs where 16-row ones would be
                #   under 8 per SM (T = 1: 16.9 us against 17.6);
                # - up to FOLD_MAX_TOKENS tokens the last down arrivals do the combine (at T = 8 it lost 2 %).
                rows = 16 if tokens * top_k * triton.cdiv(hidden, 16) >= 8 * _sm_count(device) else 8
                down = {**plan, "BLOCK_N": rows, "num_warps": 1, "PRELOAD_WORDS": True}
                if tokens <= FOLD_MAX_TOKENS:
                    down["FOLD_COMBINE"] = True
                return {"GEMV": True, "gate_up": {**plan, "PDL_TRIGGER": "start"}, "down": down}
            return {"GEMV": True, "gate_up": plan, "down": plan}
        return _packed_dot_config(tokens, num_experts, hidden, intermediate, top_k)
    if quantized and tokens <= GEMV_MAX_TOKENS:
        # The best of a sweep on the H200 (BLOCK_N 8-32, TILES 2-4, 1 or 3 stages; Mixtral, DeepSeek-V3, Qwen3-30B
        # at T=1, docs/design/moe-dispatch.md): every config within ~6 % of these, so the kernels are bound by
        # their instructions, not by the block sizes
        return {"GEMV": True,
                "gate_up": {"BLOCK_N": 8, "BLOCK_K": 128, "TILES": 4, "num_warps": 4, "num_stages": 1},
                "down": {"BLOCK_N": 16, "BLOCK_K": 128, "TILES": 4, "num_warps": 4, "num_stages": 1}}
    if quantized:
        config = _for_weights(default_config(tokens, num_experts, hidden, intermediate, top_k, device), True)
        if "BLOCK_M" in config:
            # (BLOCK_N, num_warps, num_stages) of the gate/up and the down kernel per BLOCK_M: no register spills
            # in an sm_90 compile on the CPU (triton 3.9) for int4 (symmetric, zero points, minima) and NF4; not
            # yet measured on a GPU
            up, down = {16: ((64, 4, 3), (64, 4, 3)), 32: ((64, 4, 3), (64, 4, 3)), 64: ((128, 8, 3), (128, 8, 3)),
                        128: ((32, 8, 3), (64, 8, 3))}[config["BLOCK_M"]]
            for key, rows, (n, warps, stages) in (("gate_up", intermediate, up), ("down", hidden, down)):
                config[key] = {**config[key], "BLOCK_N": _pow2_at_most(rows, n), "num_warps": warps,
                               "num_stages": stages}
        return config
    if tokens == 1 and intermediate <= STREAM_MAX_INTERMEDIATE:
        # one token on small experts: the stream kernels (`launch._streams`), 16 x 256 tiles, 4 programs per SM.
        # On the H100 (run 155, docs/design/moe-dispatch.md E58b) 1.11x the decode kernels on Qwen3-30B-A3B and
        # 1.06x on DeepSeek-V3 (I = 768 / 2048); Mixtral (I = 14336) was no faster
        plan = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 4}
        return {"STREAM": 4, "gate_up": {**plan, "BLOCK_K": _pow2_at_most(hidden, 256)},
                "down": {**plan, "BLOCK_K": _pow2_at_most(intermediate, 256)}}
    sms = _sm_count(device)
    if tokens <= DECODE_MAX_TOKENS:
        active = min(num_experts, tokens * top_k)
        # enough column blocks that each SM streams several weight slabs at once
        n_up = next((n for n in (64, 32) if active * triton.cdiv(intermediate, n) >= 4 * sms), 16)
        n_down = next((n for n in (64, 32) if active * triton.cdiv(hidden, n) >= 4 * sms), 16)
        return {
            "gate_up": {"BLOCK_N": _pow2_at_most(intermediate, n_up), "BLOCK_K": _pow2_at_most(hidden, 256),
                        "num_warps": 4, "num_stages": 4},
            "down": {"BLOCK_N": _pow2_at_most(hidden, n_down), "BLOCK_K": _pow2_at_most(intermediate, 256),
                     "num_warps": 4, "num_stages": 4},
        }
    per_expert = tokens * top_k / num_experts
    block_m = next((m for m in (16, 32, 64) if per_expert <= m), 128)
    # (BLOCK_N, BLOCK_K, num_warps, num_stages) per BLOCK_M: the winners of the H200 tuning (hubtools/bench/moe_dispatch_tune.py)
    up_n, up_k, up_warps, up_stages, down_n, down_k, down_warps, down_stages = {
        16: (64, 128, 4, 4, 64, 128, 4, 4), 32: (64, 128, 4, 4, 64, 128, 4, 4),
        64: (128, 64, 4, 4, 128, 64, 4, 4), 128: (128, 64, 8, 4, 256, 64, 8, 3),
    }[block_m]
    return {
        "BLOCK_M": block_m,
        "gate_up": {"BLOCK_N": _pow2_at_most(intermediate, up_n), "BLOCK_K": _pow2_at_most(hidden, up_k),
                    "GROUP_M": 8, "num_warps": up_warps, "num_stages": up_stages},
        "down": {"BLOCK_N": _pow2_at_most(hidden, down_n), "BLOCK_K": _pow2_at_most(intermediate, down_k),
                 "GROUP_M": 8, "num_warps": down_warps, "num_stages": down_stages},
    }


def _packed_dot_config(tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int) -> dict:
    """The tl.dot kernels' heuristic for 4-bit formats with PACKED / SWAP_AB operands (`launch._dot_flags`): 64
    weight rows per program (the wgmma's M with the weight rows as M: fewer leave it part-empty, more need 8 warps,
    which each dequantize the whole tile), 4 warps, 3 stages; BLOCK_M as the pairs per expert need, at most 64.
    On the H200 (run 59, docs/design/moe-dispatch.md) the fastest of 5-8 candidates, or within 1 % of it, at each of
    T = 16 / 128 / 4096 for Mixtral-8x7B and T = 128 / 4096 for DeepSeek-V3 and Qwen3-30B-A3B."""
    plan = {"BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    up = {**plan, "BLOCK_N": _pow2_at_most(intermediate, 64)}
    down = {**plan, "BLOCK_N": _pow2_at_most(hidden, 64)}
    if tokens <= DECODE_MAX_TOKENS:
        return {"gate_up": up, "down": down}
    per_expert = tokens * top_k / num_experts
    return {"BLOCK_M": next((m for m in (16, 32) if per_expert <= m), 64),
            "gate_up": {**up, "GROUP_M": 8}, "down": {**down, "GROUP_M": 8}}


def get_config(tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int,
               dtype: torch.dtype, device: torch.device) -> dict:
    """The tuned config of this GPU's table at the nearest token count on the same side of the decode cut,
    else the heuristic (said once in a warning on a GPU)."""
    decode = tokens <= DECODE_MAX_TOKENS
    name = _device_name(device)
    table = _tuned_configs(num_experts, hidden, intermediate, dtype, name) if name else {}
    tuned = {t: c for t, c in table.items() if (t <= DECODE_MAX_TOKENS) == decode}
    if tuned:
        return tuned[min(tuned, key=lambda t: (abs(t - tokens), t))]
    if name:
        _note_heuristic(name, num_experts, hidden, intermediate, dtype, decode)
    return default_config(tokens, num_experts, hidden, intermediate, top_k, device)


def _for_weights(config: dict, quantized: bool) -> dict:
    """4-bit experts step through K one packed tile (128 columns) at a time, and dequantize a [BLOCK_N, 128] tile
    in registers: BLOCK_K is 128 and BLOCK_N at most 128 (where the plan has one: the tensor-core GEMV's rows
    follow from its warps)."""
    return {key: {**value, "BLOCK_K": 128, **({"BLOCK_N": min(128, value["BLOCK_N"])} if "BLOCK_N" in value else {})}
            if isinstance(value, dict) else value for key, value in config.items()}


def _for_dtype(config: dict, dtype: torch.dtype) -> dict:
    """Configs are sized for 16-bit operands; 32-bit ones get half the BLOCK_K: the same shared memory per stage."""
    if dtype.itemsize != 4:
        return config
    return {key: {**value, "BLOCK_K": max(16, value["BLOCK_K"] // 2)} if isinstance(value, dict) else value
            for key, value in config.items()}
