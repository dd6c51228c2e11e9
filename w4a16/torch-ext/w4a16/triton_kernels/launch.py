"""Launchers: a config (from `tuning.select`) and the weight tensors -> grid, flags and kernel launch."""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..formats import WORDS_PER_TILE
from ..tuning import device_info, interpreting, resolve, wgmma_tail_split
from .common import _splitk_reduce_kernel
from .dequant import _dequant_kernel
from .dot import _dot_kernel
from .gemv import _gemv_h2_kernel, _gemv_kernel, _x_to_fp16_kernel
from .nf4 import NF4_HALF_TABLE_BYTES, NF4_PAIR_TABLE, NF4_PAIR_TABLE_BYTES


def _format_flags(zeros, mins, codebook, group_size) -> dict:
    per_channel = group_size == -1
    return {
        "NF4": codebook is not None,
        "HAS_ZERO": zeros is not None,
        "HAS_MIN": mins is not None,
        "PER_CHANNEL": per_channel,
        "SUBG": 128 if per_channel else min(group_size, 128),
    }


def _or(t, placeholder):
    """An absent optional tensor is passed as another tensor: its constexpr flag is off, so never read."""
    return t if t is not None else placeholder


def _nf4_shuffled_halves(plan: dict, codebook) -> int:
    """How many of a word's two nibble halves the NF4 GEMVs look up by warp shuffles: plan "nf4_shfl" true (both),
    "half" (one; the other by PRMT), absent or false (none). The interpreter runs the kernels' emulation instead."""
    choice = plan.get("nf4_shfl", False)
    if choice not in (False, True, "half"):
        raise ValueError(f"config: nf4_shfl must be true, false or \"half\"; got {choice!r}")
    if codebook is None or interpreting():
        return 0
    return {False: 0, "half": 1, True: 2}[choice]


def _reduce_splits(part, bias, out, n, swiglu, pdl: bool = False, late_trigger: bool = False) -> None:
    """`part` ``[splits, M, n]`` summed (+ bias) into `out`: ``[M, n]`` (or a column slice of a wider output), or
    with `swiglu` ``[M, n // 2]``; `pdl`: launched as a programmatic dependent of the split kernel, letting the next
    kernel launch at its start, or with `late_trigger` after its stores."""
    total = part.shape[1] * (n // 2 if swiglu else n)
    strided = out.stride(0) != out.shape[1]
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(total, block),)](
        part, _or(bias, part), out, total, n, out.stride(0), part.stride(0),
        SPLIT=part.shape[0], HAS_BIAS=bias is not None, SWIGLU=swiglu, BLOCK=block, PDL=pdl, LATE_TRIGGER=late_trigger,
        STRIDED=strided, num_warps=4, launch_pdl=pdl,
    )


@functools.lru_cache(maxsize=None)
def _shared_memory_per_block(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


@functools.lru_cache(maxsize=None)
def _shared_memory_per_sm(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_multiprocessor


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def dependent_launch(plan: dict, device: torch.device) -> bool:
    """Whether a kernel launches as a programmatic dependent of the kernel before (`common._pdl_wait`):
    plan "pdl" (default on), CUDA sm_90+, not the interpreter."""
    return (bool(plan.get("pdl", True)) and device.type == "cuda" and not interpreting() and torch.version.hip is None
            and _sm90_or_newer(device.index))


def _split_targets(x, out, n, num_tiles, per_split) -> tuple:
    """(split count, output target): `out` itself, or fp32 partial sums ``[splits, M, n]`` for `_reduce_splits`."""
    splits = triton.cdiv(num_tiles, per_split)
    target = out if splits == 1 else torch.empty(splits, x.shape[0], n, dtype=torch.float32, device=x.device)
    return splits, target


def _gemv_grid(x, qweight, out, n, k, plan, bias) -> tuple:
    """(grid, per-split tiles, split count, output target, the launch flags both GEMV kernels take)."""
    m = x.shape[0]
    num_tiles = qweight.shape[1] // WORDS_PER_TILE
    block_n, tiles = plan["block_n"], plan["tiles"]
    per_split = triton.cdiv(triton.cdiv(num_tiles, plan.get("split_k", 1)), tiles) * tiles
    splits, target = _split_targets(x, out, n, num_tiles, per_split)
    mask_tiles = num_tiles % per_split != 0
    grid = (qweight.shape[0] // block_n, splits, m)
    flags = dict(
        HAS_BIAS=bias is not None, PARTIAL=splits > 1, MASK_X=mask_tiles or k % 128 != 0, MASK_TILES=mask_tiles,
        BLOCK_N=block_n, TILES=tiles, STAGES=plan.get("num_stages", 1), PREFETCH=bool(plan.get("prefetch", False)),
        SWIGLU=plan.get("swiglu", False), num_warps=plan.get("num_warps", 4),
    )
    return grid, per_split, splits, target, flags


def _launch_gemv(x, qweight, scales, zeros, mins, codebook, bias, out, n, k, group_size, plan) -> None:
    grid, per_split, splits, target, flags = _gemv_grid(x, qweight, out, n, k, plan, bias)
    m, num_tiles = x.shape[0], qweight.shape[1] // WORDS_PER_TILE
    _gemv_kernel[grid](
        x, qweight, scales, _or(zeros, scales), _or(mins, scales),
        _or(codebook, scales), _or(bias, scales), target,
        n, k, num_tiles, per_split, qweight.shape[1] * 8 if group_size == -1 else group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), target.stride(-2), m * n,
        **_format_flags(zeros, mins, codebook, group_size), **flags,
    )
    if splits > 1:
        _reduce_splits(target, bias, out, n, plan.get("swiglu", False))


def _nf4_table_flags(plan: dict, codebook) -> dict:
    """NF4's lookup in the GEMVs and the wgmma kernel: the shared-memory pair table (`nf4._nf4_pair_table`, linked
    from `nf4_table.ll`; E73, E74) unless the plan sets "nf4_smem" false or asks for warp shuffles ("nf4_shfl")."""
    shuffles = plan.get("nf4_shfl", False)
    choice = plan.get("nf4_smem", not shuffles)
    if choice not in (False, True):
        raise ValueError(f"config: nf4_smem must be true or false; got {choice!r}")
    if choice and shuffles:
        raise ValueError("config: nf4_smem and nf4_shfl are two NF4 lookups; set one")
    if not choice or codebook is None or interpreting() or not _allow_static_shared_memory():
        return {}
    return dict(NF4_SMEM=True, extern_libs={"nf4_table": NF4_PAIR_TABLE.value})


@functools.cache
def _libcuda():
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def _allow_static_shared_memory() -> bool:
    """Triton's loader (3.6, driver.c `loadBinary`) raises a kernel's dynamic shared-memory limit only where its
    own allocation is over 48 KB, while the driver's default caps static + dynamic at 48 KB; Triton kernels have
    no static part unless one is linked in (the NF4 pair table), so such a kernel with 16-48 KB of its own would
    fail to launch. A load hook (chained to any other) raises the limit of kernels that have a static part to
    the card's opt-in maximum less that part, as the loader does above 48 KB. False where this Triton has no
    load hook (then the NF4 GEMVs keep the PRMT lookup)."""
    import ctypes

    try:
        from triton import knobs
    except ImportError:
        return False
    if not hasattr(knobs.runtime, "kernel_load_end_hook"):
        return False
    previous = knobs.runtime.kernel_load_end_hook

    def hook(module, function, name, metadata_group, hash):
        cuda, static, optin, device = _libcuda(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        cuda.cuFuncGetAttribute(ctypes.byref(static), 1, ctypes.c_void_p(function))  # SHARED_SIZE_BYTES
        if static.value:
            cuda.cuCtxGetDevice(ctypes.byref(device))
            cuda.cuDeviceGetAttribute(ctypes.byref(optin), 97, device)  # MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
            cuda.cuFuncSetAttribute(ctypes.c_void_p(function), 8, optin.value - static.value)  # MAX_DYNAMIC_SHARED
        if previous is not None:
            previous(module, function, name, metadata_group, hash)

    knobs.runtime.kernel_load_end_hook = hook
    return True


def _persistent_grid(plan: dict, grid: tuple, device: torch.device) -> tuple[tuple, dict]:
    """The packed GEMV's grid and flags for plan "persistent" (E73): at most that many programs an SM, taking the
    grid's items in turn (a 1-D grid); absent, the grid as it is."""
    per_sm = plan.get("persistent")
    if per_sm is None:
        return grid, {}
    if isinstance(per_sm, bool) or not isinstance(per_sm, int) or per_sm < 1:
        raise ValueError(f"config: persistent must be a positive number of programs an SM; got {per_sm!r}")
    items = grid[0] * grid[1] * grid[2]
    programs = min(items, device_info(device)[1] * per_sm)
    return (programs,), dict(PERSISTENT=True, row_blocks=grid[0], splits=grid[1], items=items)


def _trigger_flag(plan: dict) -> dict:
    """The packed GEMV's "pdl_trigger" (E66, docs/design/w4a16.md), refused by name when malformed: "end", the
    default, lets the next kernel launch after the K loop; "start" right after the wait."""
    trigger = plan.get("pdl_trigger", "end")
    if trigger not in ("end", "start"):
        raise ValueError(f"config: pdl_trigger must be 'end' or 'start', got {trigger!r}")
    return dict(TRIGGER_START=trigger == "start")


def _register_cap(plan: dict) -> dict:
    """Triton's `maxnreg` from a plan's "maxnreg" (registers a thread). ptxas gives the NF4 one-token GEMV twice
    int4's registers on the same plan (168 against 56-80 in sm_90a compiles) for latency it could hide with more
    programs an SM; capped at 96 it compiles without spills to the same loop (E83). A cap above what ptxas takes
    raises its count instead, so it is a plan's choice, not a default."""
    cap = plan.get("maxnreg")
    if cap is None:
        return {}
    if isinstance(cap, bool) or not isinstance(cap, int) or not 24 <= cap <= 255:
        raise ValueError(f"config: maxnreg (registers a thread) must be an int from 24 to 255; got {cap!r}")
    return {"maxnreg": cap}


def _launch_gemv_h2(x, qweight, scales, zeros, mins, codebook, bias, out, n, k, group_size, plan) -> None:
    """`_gemv_h2_kernel` (`tuning.half2_supported` says for which formats)."""
    trigger = _trigger_flag(plan)
    nf4_table = _nf4_table_flags(plan, codebook)
    register_cap = _register_cap(plan)
    grid, per_split, splits, target, flags = _gemv_grid(x, qweight, out, n, k, plan, bias)
    m, num_tiles = x.shape[0], qweight.shape[1] // WORDS_PER_TILE
    x_scaled = x.dtype == torch.bfloat16
    x_scales = scales  # unread unless X_SCALED
    pdl = dependent_launch(plan, qweight.device)
    if x_scaled:
        x16 = torch.empty(m, k, dtype=torch.float16, device=x.device)
        x_scales = torch.empty(m, num_tiles, dtype=torch.float32, device=x.device)
        _x_to_fp16_kernel[(m, triton.cdiv(num_tiles, 8))](x, x16, x_scales, k, num_tiles, x.stride(0),
                                                           x16.stride(0), TILES=8, PDL=pdl, num_warps=4,
                                                           launch_pdl=pdl)
        x = x16
    w_desc = bool(plan.get("tma", False))
    qw = qweight
    if w_desc:  # TMA boxes of [block_n, tiles, 16] words (a host descriptor: encoded per launch, no scratch)
        qw = TensorDescriptor(qweight, [qweight.shape[0], num_tiles, WORDS_PER_TILE],
                              [qweight.stride(0), WORDS_PER_TILE, 1], [plan["block_n"], plan["tiles"], WORDS_PER_TILE])
    h2_grid, persistent = _persistent_grid(plan, grid, qweight.device)
    _gemv_h2_kernel[h2_grid](
        x, x_scales, qw, scales, _or(zeros, scales), _or(mins, scales), _or(codebook, scales), _or(bias, scales),
        target, n, k, num_tiles, per_split, qweight.shape[1] * 8 if group_size == -1 else group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), target.stride(-2), m * n,
        HAS_ZERO=zeros is not None, HAS_MIN=mins is not None, PER_CHANNEL=group_size == -1, X_SCALED=x_scaled,
        NF4=codebook is not None, HALF_GROUPS=codebook is not None and group_size == 64,
        INT4_GROUPS=128 // group_size if codebook is None and group_size in (32, 64) else 1,
        X_BCAST=bool(plan.get("x_bcast", False)), W_DESC=w_desc, EMULATE=interpreting(),
        NF4_SHFL=_nf4_shuffled_halves(plan, codebook),
        # masked tiles mask x per tile (MASK_TILES); descriptor boxes are loaded in the loop, not ahead
        **dict(flags, MASK_X=k % 128 != 0, PREFETCH=flags["PREFETCH"] and not w_desc), PDL=pdl, launch_pdl=pdl,
        **trigger, **nf4_table, **persistent, **register_cap,
    )
    if splits > 1:
        _reduce_splits(target, bias, out, n, plan.get("swiglu", False), pdl)


def _launch_dot(x, qweight, scales, zeros, mins, codebook, bias, out, n, k, group_size, plan) -> None:
    m = x.shape[0]
    num_tiles = qweight.shape[1] // WORDS_PER_TILE
    block_m, block_n = plan["block_m"], plan["block_n"]
    per_split = triton.cdiv(num_tiles, plan.get("split_k", 1))
    splits, target = _split_targets(x, out, n, num_tiles, per_split)
    flags = _format_flags(zeros, mins, codebook, group_size)
    grid = (triton.cdiv(m, block_m) * (qweight.shape[0] // block_n), splits)
    x_arg, qw_arg = x, qweight
    if plan.get("x_desc", False):  # host descriptors: encoded per launch, captured by value in CUDA graphs
        x_arg = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, 128])
    if plan.get("w_desc", False):
        qw_arg = TensorDescriptor(qweight, list(qweight.shape), [qweight.stride(0), 1], [block_n, WORDS_PER_TILE])
    pdl = dependent_launch(plan, qweight.device)
    _dot_kernel[grid](
        x_arg, qw_arg, scales, _or(zeros, scales), _or(mins, scales),
        _or(codebook, scales), _or(bias, scales), target,
        # a compile-time group size: the group of a tile is then a shift, not a division per K-tile (per channel
        # it is never read)
        m, n, k, num_tiles, per_split, 128 if group_size == -1 else group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), target.stride(-2), m * n,
        **flags, HAS_BIAS=bias is not None, PARTIAL=splits > 1, MASK_K=k % 128 != 0,
        SCALE_ON_ACC=flags["SUBG"] == 128 and not flags["PER_CHANNEL"] and mins is None,
        BLOCK_M=block_m, BLOCK_N=block_n, SWAP_AB=bool(plan.get("swap_ab", False)), STAGES=plan.get("num_stages", 2),
        FULL_TILE=bool(plan.get("full_tile", False)),
        # The interpreter computes bf16 dots wrongly (triton 3.9): it gets fp32 operands instead.
        UPCAST=interpreting() and x.dtype == torch.bfloat16,
        PACKED=plan["packed"],
        X_DESC=bool(plan.get("x_desc", False)), W_DESC=bool(plan.get("w_desc", False)),
        NF4_TABLES=bool(plan.get("nf4_tables", False)),
        NF4_HALF_SCALE=bool(plan.get("nf4_half_scale", False)) and scales.dtype == torch.float16,
        EMULATE=interpreting(), SWIGLU=plan.get("swiglu", False), PDL=pdl, launch_pdl=pdl,
        num_warps=plan.get("num_warps", 4),
        **_dot_nf4_table_flags(plan, codebook, x),
    )
    if splits > 1:
        # The next kernel (the next layer's dot, two programs per SM) let launch only once the sums are stored:
        # launched at the reduction's start, its programs took SM slots beside this kernel's tail, and at one
        # wave or less of dot programs that cost up to 1.2x (docs/design/w4a16.md E25).
        _reduce_splits(target, bias, out, n, plan.get("swiglu", False), pdl, late_trigger=True)


# Programs an SM the dot kernel's registers allow, times its warps: its tiles take 95-118 registers a thread on
# sm_90a (run 184), so at most 128, 16 warps' worth of a 64K register file
_DOT_REGISTER_WARPS = 16


def _dot_nf4_table_flags(plan: dict, codebook, x) -> dict:
    """The dot path's NF4 lookup: the larger shared-memory pair table (32 KB, then E75's 16 KB half table) that
    leaves as many programs an SM as the kernel has without it, else the byte permutes. On the H100 (run 184, NF4
    g64 at M = 64, 14 shapes) the whole table cut 64 x 64 tiles of 4 warps from 3 programs an SM to 2 and lost
    0.66-0.99x, where the half table kept 3 and won 1.03-1.14x on 5 of 8 (a tie on one, 5 % slower on the two
    short-K Qwen2.5-1.5B ones); on 8-warp tiles (2 programs, register bound) the whole table won 1.08-1.16x, 2-5 %
    past the half; at 4 stages it cut them to 1 (0.84x) and the half table won (1.14x). The rule picks the best of
    the three on 11 of 14, 1.07x the byte permutes in geomean. A plan may pin the lookup: "nf4_smem": false (byte
    permutes), "nf4_table_copies": 16 / 32 (that table where it fits beside the pipeliner's buffers at all: a
    256 x 128 tile of 3 stages does not, and failed to launch, run 179)."""
    copies = plan.get("nf4_table_copies")
    if copies not in (None, 16, 32):
        raise ValueError(f"config: nf4_table_copies (copies of each pair-table entry) must be 16 or 32; got {copies!r}")
    flags = _nf4_table_flags(plan, codebook) if plan.get("nf4_tables") else {}
    if not flags:
        return {}
    # the pipeliner's buffers (sm_90a compiles of 16 x 64 to 256 x 128 tiles, 2-4 stages, TMA or pointer loads):
    # x's tile in every stage, the words' in all but one, and up to 64 bytes of barriers
    stages = plan.get("num_stages", 2)
    used = stages * plan["block_m"] * 128 * x.element_size() + (stages - 1) * plan["block_n"] * WORDS_PER_TILE * 4 + 64
    tables = (NF4_PAIR_TABLE_BYTES, NF4_HALF_TABLE_BYTES)
    if copies is None:
        per_sm = _shared_memory_per_sm(x.device.index)
        cap = max(1, _DOT_REGISTER_WARPS // plan.get("num_warps", 4))

        def programs(table: int) -> int:  # an SM's programs beside `table` bytes, 1 KB of slack each
            return min(cap, per_sm // (used + table + 1024))

        tables = [table for table in tables if programs(table) >= programs(0)]
    else:
        tables = [NF4_HALF_TABLE_BYTES if copies == 16 else NF4_PAIR_TABLE_BYTES]
    for table in tables:
        if _fits_beside(used, table, x.device.index):
            return {**flags, "NF4_SMEM": 16} if table == NF4_HALF_TABLE_BYTES else flags
    return {}


def _fits_beside(used: int, table: int, device_index) -> bool:
    """Whether a table's static `table` bytes fit beside `used` bytes of a kernel's own shared memory (less 1 KB
    of slack for barriers) on this device."""
    return used + table <= _shared_memory_per_block(device_index) - 1024


def _nf4_table_beside(plan: dict, codebook, used: int, device_index) -> dict:
    """`_nf4_table_flags` where the whole table fits beside `used` bytes of a kernel's own shared memory, else
    none (the byte permutes)."""
    flags = _nf4_table_flags(plan, codebook)
    return flags if flags and _fits_beside(used, NF4_PAIR_TABLE_BYTES, device_index) else {}


def _launch_wgmma(x, qweight, scales, zeros, mins, codebook, bias, out, n, k, group_size, plan) -> None:
    """`wgmma._wgmma_kernel` (Hopper only, `tuning.wgmma_supported`): persistent programs, at most one an SM, each
    looping over output blocks (token tile, row tile of 128 or 256, K split); x and the words by host descriptors
    (encoded per launch, captured by value in CUDA graphs), the output by TMA stores left in flight where
    `_wgmma_columns` finds they apply (else pointer stores). ``"split_k"``: a count, or ``"auto"``
    (`tuning.wgmma_tail_split`: maybe the first row-tile columns unsplit and the rest split in a second launch)."""
    m, block_m, block_n = x.shape[0], plan["block_m"], plan.get("block_n", 128)
    inflight, chains = plan.get("inflight", 1), plan.get("chains", 2)
    if chains not in (1, 2):
        raise ValueError(f"config: wgmma chains (64-row chains a warpgroup) must be 1 or 2; got {plan}")
    if block_n not in (64 * chains, 128 * chains) or qweight.shape[0] % block_n:
        raise ValueError("config: wgmma block_n (rows per tile: a dequantizing warpgroup per 64 x chains) must be "
                         f"{64 * chains} or {128 * chains} and divide the padded rows ({qweight.shape[0]}); got {plan}")
    if block_m > 128 * (3 - chains):
        raise ValueError("config: wgmma block_m (tokens per tile, the MMA's N) is at most 128 with two chains a "
                         f"warpgroup and 256 with one (the accumulators' registers); got {plan}")
    if inflight not in (1, 2, 3):
        raise ValueError(f"config: wgmma inflight (chunks of MMAs in flight) must be 1, 2 or 3; got {plan}")
    split = plan.get("split_k", 1)
    columns = qweight.shape[0] // block_n
    if split == "auto":  # (columns, 1) unsplit, (0, split) all split, or whole waves then the rest split
        first, split = wgmma_tail_split(m, qweight.shape[0], k, block_m, block_n, device_info(x.device)[1])
    elif not isinstance(split, int) or split < 1:
        raise ValueError(f'config: wgmma split_k must be a positive count or "auto"; got {plan}')
    else:
        first = columns if split == 1 else 0
    params = (scales, zeros, mins, bias)
    if first:
        _wgmma_columns(x, qweight, params, codebook, out, n, k, group_size, plan, 0, first, 1)
    if first < columns:
        _wgmma_columns(x, qweight, params, codebook, out, n, k, group_size, plan, first, columns, split)


def _wgmma_columns(x, qweight, params, codebook, out, n, k, group_size, plan, first, last, split) -> None:
    """One `_wgmma_kernel` launch on row-tile columns [first, last) of the weight, K in `split` parts (then its
    reduction writes those columns of `out`)."""
    # imported here: Triton builds without Gluon's Hopper ops never reach this launcher (`wgmma_supported`)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from .warp_specialize import unlooped_workers
    from .wgmma import _wgmma_kernel

    m, block_m, block_n, chains = x.shape[0], plan["block_m"], plan.get("block_n", 128), plan.get("chains", 2)
    row0 = first * block_n
    if row0:  # the columns' own weights, parameters and outputs: views from row0 on, nothing copied
        qweight, out = qweight[row0:], out[:, row0:]
        params = tuple(None if p is None else p[..., row0:] for p in params)
        n -= row0
    scales, zeros, mins, bias = params
    num_tiles = qweight.shape[1] // WORDS_PER_TILE
    per_split = triton.cdiv(num_tiles, split)
    splits = triton.cdiv(num_tiles, per_split)
    # plan "scales_tma" (on unless the plan says False): the K-tile's group rows of scales (zero points, minima)
    # come through the ring with the words. One group a K-tile (g >= 128, per channel; E54): 1.005-1.11x over the
    # consumers' own loads on every shape, format and dtype measured (H100, docs/design/w4a16.md runs 147-148).
    # Groups of 64 (two rows a box; E80, run 190, H100, M = 256 / 1024, 8 Llama-3 shapes): int4 with zero points
    # 1.30-1.41x, NF4 1.04-1.21x but one case (0.96x); groups of 32 take four rows the same way.
    one_group = group_size == -1 or group_size >= 128
    scales_tma = bool(plan.get("scales_tma", True))
    group_rows = 1 if one_group else 128 // group_size
    group_row = (sum(p.element_size() for p in (scales, zeros, mins) if p is not None) * block_n * group_rows
                 if scales_tma else 0)
    # the output by TMA stores where TMA can write it and its buffers (per 64-row chain 64 columns of x's dtype or
    # 32 of fp32) fit beside the ring: 1.02-1.07x over pointer stores after a layout conversion, the stores of one
    # block overlapping the next block's start (docs/design/w4a16.md E50)
    ring = plan.get("num_stages", 4) * (block_n * WORDS_PER_TILE * 4 + block_m * 128 * x.element_size() + group_row)
    # NF4 from the pair table (E74) where it fits beside the ring, else by byte permutes; the TMA stores' buffers
    # below then have to fit beside both
    nf4_table = _nf4_table_beside(plan, codebook, ring, x.device.index)
    shared = _shared_memory_per_block(x.device.index) - 1024 - (NF4_PAIR_TABLE_BYTES if nf4_table else 0)
    consumers = block_n // (64 * chains)
    fits = ring + block_n * block_m * 2 <= shared
    # a split's fp32 partial sums by TMA stores too (E51: 1.02x at M = 256) where their rows are 16-byte aligned
    # and a chain's fp32 tile a consumer fits, each part's rows padded to whole token tiles so that no tile's box
    # reaches into the next part
    partial_tma = ring + consumers * block_m * 64 * 4 <= shared and splits > 1 and n % 4 == 0
    if partial_tma:
        padded = torch.empty(splits, triton.cdiv(m, block_m) * block_m, n, dtype=torch.float32, device=x.device)
        target = padded[:, :m]
    else:
        splits, target = _split_targets(x, out, n, num_tiles, per_split)
    x_type = gl.float16 if x.dtype == torch.float16 else gl.bfloat16
    x_desc = GluonDescriptor(x, [m, k], [x.stride(0), 1], [block_m, 128],
                             gl.NVMMASharedLayout.get_default_for([block_m, 128], x_type))
    w_desc = GluonDescriptor(qweight, [(last - first) * block_n, qweight.shape[1]], [qweight.stride(0), 1],
                             [block_n, WORDS_PER_TILE], gl.NVMMASharedLayout.get_default_for([block_n, WORDS_PER_TILE],
                                                                                              gl.int32))
    tma_store = partial_tma or fits and (splits == 1 and (target.stride(0) * target.element_size()) % 16 == 0
                          and target.data_ptr() % 16 == 0)
    if tma_store and partial_tma:
        out_desc = GluonDescriptor(padded.view(-1, n), [padded.shape[0] * padded.shape[1], n], [n, 1], [block_m, 32],
                                   gl.NVMMASharedLayout.get_default_for([block_m, 32], gl.float32))
    elif tma_store:
        out_desc = GluonDescriptor(target, [m, n], [target.stride(0), 1], [block_m, 64],
                                   gl.NVMMASharedLayout.get_default_for([block_m, 64], x_type))
    else:
        out_desc = x_desc
    if scales_tma:
        s_desc, z_desc, m_desc = (
            x_desc if p is None else GluonDescriptor(p, [p.shape[0], (last - first) * block_n], [p.stride(0), 1],
                                                     [group_rows, block_n], gl.NVMMASharedLayout(0, p.element_size() * 8))
            for p in (scales, zeros, mins))
    else:
        s_desc = z_desc = m_desc = x_desc
    # persistent programs: the ring runs on from one block into the next (E49)
    programs = min(triton.cdiv(m, block_m) * (last - first) * splits, device_info(x.device)[1])
    # a second consumer warpgroup is a worker partition, which pipelines only in the edited PTX
    with unlooped_workers(_wgmma_kernel.__name__) if consumers == 2 else contextlib.nullcontext():
        _wgmma_kernel[(programs,)](
            x_desc, w_desc, s_desc, z_desc, m_desc, scales, _or(zeros, scales), _or(mins, scales),
            _or(codebook, scales), _or(bias, scales), target, out_desc, m, n, last - first, num_tiles, per_split,
            scales.stride(0), target.stride(-2),
            GROUP=128 if group_size == -1 else group_size, PER_CHANNEL=group_size == -1, HAS_ZERO=zeros is not None,
            HAS_MIN=mins is not None, NF4=codebook is not None, HAS_BIAS=bias is not None, PARTIAL=splits > 1,
            STAGES=plan.get("num_stages", 4), INFLIGHT=plan.get("inflight", 1), TMA_STORE=tma_store,
            SCALES_TMA=scales_tma, CHAINS=chains, num_warps=4, **nf4_table,
        )
    if splits > 1:
        _reduce_splits(target, bias, out, n, False)


def _launch_mma(x, qweight, scales, zeros, mins, codebook, bias, out, n, k, group_size, plan) -> None:
    """`mma._mma_gemv_kernel` (sm_80+, `tuning.mma_supported`): one program per (token tile of ``block_m`` = 8, 16,
    32 or 64, row tile of 16 x ``num_warps`` x ``reps``, K split)."""
    # imported here: Triton builds without Gluon never reach this launcher (`mma_supported`)
    from .mma import _mma_gemv_kernel

    m, warps, reps = x.shape[0], plan.get("num_warps", 4), plan.get("reps", 1)
    block_m = plan.get("block_m", 8 if m <= 8 else 16)
    block_n = 16 * warps * reps
    tiles, stages = plan.get("tiles", 1), plan.get("stages", 1)
    smem_x = plan.get("x_smem") or stages > 1
    if (block_m not in (8, 16, 32, 64) or qweight.shape[0] % block_n or (smem_x and tiles & (tiles - 1))
            or not isinstance(stages, int) or stages < 1):
        raise ValueError(f"config: mma block_m must be 8, 16, 32 or 64, 16 x num_warps x reps must divide the padded "
                         f"rows ({qweight.shape[0]}), x_smem and stages > 1 need a power-of-two tiles and stages is a "
                         f"positive integer; got {plan}")
    num_tiles = qweight.shape[1] // WORDS_PER_TILE
    per_split = triton.cdiv(num_tiles, plan.get("split_k", 1))
    splits, target = _split_targets(x, out, n, num_tiles, per_split)
    pdl = dependent_launch(plan, qweight.device)
    _mma_gemv_kernel[(triton.cdiv(m, block_m), qweight.shape[0] // block_n, splits)](
        x, qweight, scales, _or(zeros, scales), _or(codebook, scales), _or(bias, scales), target, m, n, k, num_tiles,
        per_split, x.stride(0), qweight.stride(0), scales.stride(0), target.stride(-2), target.stride(0),
        GROUP=128 if group_size == -1 else group_size, PER_CHANNEL=group_size == -1, HAS_ZERO=zeros is not None,
        NF4=codebook is not None, HAS_BIAS=bias is not None, PARTIAL=splits > 1, BLOCK_M=block_m, REPS=reps,
        TILES=tiles, MASK_K=k % 128 != 0, X_SMEM=bool(plan.get("x_smem", False)), STAGES=stages, num_warps=warps,
        PDL=pdl, launch_pdl=pdl, NF4_SHFL=_nf4_shuffled_halves(plan, codebook),
        **_nf4_table_flags(plan, codebook),
    )
    if splits > 1:
        _reduce_splits(target, bias, out, n, False, pdl)


def dequantize(qweight, scales, zeros, codebook, n, k, group_size, dtype, out=None, mins=None, *, block_n=32,
               tiles=4, num_warps=4, nf4_tables=False, int4_pairs=True, stages=0,
               w_desc=False) -> torch.Tensor:
    """Dequantized weight ``[n, k]`` in stored K order (rows of a chunk when qweight is a row slice): programs of
    ``block_n`` rows x ``tiles`` K-tiles. ``nf4_tables``: NF4 looked up from its codebook rounded to fp16 (the
    tensor-core path's values: what the matmul uses; `ops.dequantize` keeps the float32 codebook); ``int4_pairs``:
    int4 into a 16-bit output of the scales' dtype by packed instructions (bit-equal; off: the float32 planes).
    ``stages`` > 1: the program's word loads pipelined that deep; ``w_desc``: by TMA (a host descriptor; CUDA
    only)."""
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    num_tiles = qweight.shape[1] // WORDS_PER_TILE
    flags = _format_flags(zeros, mins, codebook, group_size)
    del flags["SUBG"]
    grid = (triton.cdiv(n, block_n), triton.cdiv(num_tiles, tiles))
    qw_arg = qweight
    if w_desc and qweight.is_cuda and not interpreting():
        qw_arg = TensorDescriptor(qweight, [n, qweight.shape[1]], [qweight.stride(0), 1], [block_n, WORDS_PER_TILE])
    _dequant_kernel[grid](
        qw_arg, scales, _or(zeros, scales), _or(mins, scales),
        _or(codebook, scales), out,
        n, k, num_tiles, 128 if group_size == -1 else group_size,  # a compile-time constant, unread per channel
        qweight.stride(0), scales.stride(0), out.stride(0),
        **flags, BLOCK_N=block_n, TILES=tiles, NF4_TABLES=nf4_tables and codebook is not None,
        # packed fp16 multiplies are inline PTX: not in the interpreter
        HALF_SCALE=out.dtype == torch.float16 and scales.dtype == torch.float16 and not interpreting(),
        # int4 pairs in packed 16-bit arithmetic (inline PTX), with scales of the output's dtype
        INT4_PAIRS=(int4_pairs and codebook is None and mins is None and out.dtype == scales.dtype
                    and out.dtype in (torch.float16, torch.bfloat16) and not interpreting()),
        EMULATE=interpreting(), STAGES=stages, W_DESC=qw_arg is not qweight,
        num_warps=num_warps,
    )
    return out


def _launch_dequant_matmul(x, qweight, scales, zeros, mins, codebook, bias, out, n, k, group_size, plan) -> None:
    """Dequantize (in row chunks of `chunk_n`, so the fp16 copy can stay in L2) and multiply with cuBLAS. With
    the SwiGLU epilogue cuBLAS writes the fused rows ``[M, n]`` (x's dtype, bias added in its epilogue) and the
    reduction kernel, with one split, applies silu(gate) * up in one more launch: a Triton kernel rather than
    torch ops, which take three launches and fp32 temporaries in eager mode."""
    swiglu = plan.get("swiglu", False)
    fused = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device) if swiglu else out
    chunk = plan.get("chunk_n") or n
    tiling = {key: plan[key] for key in ("block_n", "tiles", "num_warps", "nf4_tables", "stages", "w_desc") if key in plan}
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        weight = dequantize(qweight[start:], scales[:, start:], None if zeros is None else zeros[:, start:],
                            codebook, stop - start, k, group_size, x.dtype,
                            mins=None if mins is None else mins[:, start:], **tiling)
        target = fused[:, start:stop]
        if bias is None:
            torch.mm(x, weight.t(), out=target)
        else:
            torch.addmm(bias[start:stop], x, weight.t(), out=target)
    if swiglu:
        _reduce_splits(fused[None], None, out, n, True)


_LAUNCHERS = {"gemv": _launch_gemv, "gemv_h2": _launch_gemv_h2, "dot": _launch_dot, "wgmma": _launch_wgmma,
              "mma": _launch_mma, "dequant": _launch_dequant_matmul}


def matmul(x, qweight, scales, zeros, codebook, bias, n, k, group_size, config, out=None,
           swiglu=False, mins=None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x ``[M, K]`` with unit column stride, already in stored K order; `config` (a
    table entry or an explicit one) is resolved here, once, into the plan the launchers run. `swiglu`: W is a
    fused gate / up weight in the SwiGLU layout (n a multiple of 16) and the result ``[M, n // 2]`` is
    silu(gate) * up, computed in each kernel's epilogue from its fp32 accumulators. `mins`: the weight's float
    minima (`formats.QuantizedWeight.mins`) or None."""
    if out is None:
        out = torch.empty(x.shape[0], n // 2 if swiglu else n, dtype=x.dtype, device=x.device)
    plan = resolve(config, x, codebook, group_size, swiglu, has_mins=mins is not None, has_zeros=zeros is not None)
    _LAUNCHERS[plan["kernel"]](x, qweight, scales, zeros, mins, codebook, bias, out, n, k, group_size, plan)
    return out
