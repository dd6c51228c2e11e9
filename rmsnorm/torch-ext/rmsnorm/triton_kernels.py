"""Triton kernels for RMSNorm, fused residual-add RMSNorm and their backward, with their launchers.

Every tensor handed to a launcher is a 2-D row view `[rows, cols]` whose columns are contiguous; row
strides are passed explicitly, so strided views (e.g. a slice of a fused QKV output) need no copy.

Launch shapes come from the table of the running GPU, `configs/<gpu>.json` beside this file (measured with
`python -m hubtools.bench.rmsnorm tune`), indexed by the row block (the next power of two of the hidden
size); a row block the table lacks, and every GPU without a table, take `heuristic_config`, said once per
GPU, kind and block in a warning. Nothing is autotuned at import or call time.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)
CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"
# The widest row block one program holds in registers; wider rows take the two-pass (looped) kernels.
_MAX_BLOCK = {"forward": 32768, "fused_add": 32768, "backward": 16384}
_LOOPED = {"forward": {"block": 8192, "num_warps": 16}, "fused_add": {"block": 8192, "num_warps": 16},
           "backward": {"block": 4096, "num_warps": 16, "programs_per_sm": 1}}
# Programs per launch for backward on a device without SMs (the Triton interpreter on CPU tensors).
_INTERPRETER_PROGRAMS = 4


@triton.jit
def _normalize(xf, rstd, w, offset, IN_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
               ROUND_BEFORE_WEIGHT: tl.constexpr):
    """fp32 output before the final cast: Llama rounds x * rstd to the input dtype and then multiplies
    by w; Gemma multiplies by (offset + w) in fp32 and rounds once."""
    xhat = xf * rstd
    if HAS_WEIGHT:
        if ROUND_BEFORE_WEIGHT:
            return xhat.to(IN_DTYPE).to(tl.float32) * w
        return xhat * (w + offset)
    return xhat


@triton.jit
def _weight_scale(weight_ptr, cols, mask, offset, ROUND_BEFORE_WEIGHT: tl.constexpr):
    """What dy is multiplied by in backward: w (Llama) or offset + w (Gemma), in fp32."""
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if not ROUND_BEFORE_WEIGHT:
        w += offset
    return w


@triton.jit
def _load_streamed(ptr, mask, EVICT_FIRST: tl.constexpr):
    """Load data read once: with EVICT_FIRST it is marked first out of L2 (a tuned choice per row block)."""
    if EVICT_FIRST:
        return tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _store_streamed(ptr, value, mask, EVICT_FIRST: tl.constexpr):
    if EVICT_FIRST:
        tl.store(ptr, value, mask=mask, eviction_policy="evict_first")
    else:
        tl.store(ptr, value, mask=mask)


# Programmatic dependent launch (sm_90+, `_dependent_launch`): the forward kernels are launched with `launch_pdl`,
# so one may be scheduled while the kernel before it (a w4a16 GEMV, attention) drains; it waits in
# griddepcontrol.wait (that kernel complete, its writes visible) before touching memory, and lets the kernel after
# it (w4a16's decode GEMVs are launched the same way) launch once its rows are loaded. In batch-1 decode a norm is
# one short program between two matmuls, so most of its cost is the launch gap this hides.
@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _pdl_launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _forward_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    n_rows, n_cols, x_stride, residual_stride, out_stride, sum_stride,
    eps, offset,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, EVICT_FIRST: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, PDL: tl.constexpr,
):
    """ROWS whole rows per program, each row held in registers: one read and one write per element. PDL: a
    programmatic dependent of the kernel before (`_pdl_wait`), the next one let launch once the rows are
    loaded."""
    _pdl_wait(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)[:, None]
    x = _load_streamed(x_ptr + rows * x_stride + cols[None, :], mask, EVICT_FIRST)
    if HAS_RESIDUAL:
        r = _load_streamed(residual_ptr + rows * residual_stride + cols[None, :], mask, EVICT_FIRST)
        # Rounded to the activation dtype, exactly like the unfused `x + residual`.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        _store_streamed(sum_ptr + rows * sum_stride + cols[None, :], x, mask, EVICT_FIRST)
    _pdl_launch_dependents(PDL)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)[:, None]
    w = 0.0
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    y = _normalize(xf, rstd, w, offset, x_ptr.dtype.element_ty, HAS_WEIGHT, ROUND_BEFORE_WEIGHT)
    _store_streamed(out_ptr + rows * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask, EVICT_FIRST)


@triton.jit
def _forward_looped_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    n_rows, n_cols, x_stride, residual_stride, out_stride, sum_stride,
    eps, offset,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, PDL: tl.constexpr,
):
    """One row per program for rows wider than a register block: the first pass sums squares (and writes
    x + residual), the second re-reads the row, which the first pass left in L2. PDL as in `_forward_kernel`
    (the next kernel let launch after the first pass)."""
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    sum_row = sum_ptr + row * sum_stride
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0,
                        eviction_policy="evict_first")
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_row + cols, x, mask=mask, eviction_policy="evict_last")
        xf = x.to(tl.float32)
        acc += xf * xf
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
    _pdl_launch_dependents(PDL)
    if HAS_RESIDUAL:
        # The second pass reads back the sums other threads of this program stored.
        tl.debug_barrier()
        src_row = sum_row
    else:
        src_row = x_row
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        xf = tl.load(src_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = 0.0
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        y = _normalize(xf, rstd, w, offset, x_ptr.dtype.element_ty, HAS_WEIGHT, ROUND_BEFORE_WEIGHT)
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask,
                 eviction_policy="evict_first")


@triton.jit
def _load_x_and_grad(x_ptr, grad_out_ptr, rows, row_end, cols, col_mask, x_stride, grad_out_stride):
    """x and dy of `rows` (those below row_end), in their storage dtype."""
    mask = (rows < row_end)[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * x_stride + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    dy = tl.load(grad_out_ptr + rows * grad_out_stride + cols[None, :], mask=mask, other=0.0,
                 eviction_policy="evict_first")
    return x, dy


@triton.jit
def _backward_kernel(
    grad_out_ptr, x_ptr, weight_ptr, grad_sum_ptr, grad_x_ptr, partial_ptr,
    n_rows, n_cols, rows_per_program, grad_out_stride, x_stride, grad_sum_stride, grad_x_stride,
    eps, offset,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, HAS_GRAD_SUM: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
):
    """dx for a contiguous run of rows, and this program's fp32 partial sum of dw (one row of `partial`).

    rstd is recomputed from x, which is read anyway, so the forward never writes it.
    With xhat = x * rstd and g = dy * scale: dx = rstd * (g - xhat * mean(g * xhat)).
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    scale = 1.0
    if HAS_WEIGHT:
        scale = _weight_scale(weight_ptr, cols, col_mask, offset, ROUND_BEFORE_WEIGHT)[None, :]
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    offs = tl.arange(0, ROWS)
    # Loads run one step ahead of the math (software pipelining by hand): with few programs per SM,
    # the next rows' x and dy are in flight while this step reduces and stores.
    x_next, dy_next = _load_x_and_grad(x_ptr, grad_out_ptr, row_start + offs, row_end, cols, col_mask, x_stride,
                                       grad_out_stride)
    for first in range(row_start, row_end, ROWS):
        rows = first + offs
        row_mask = (rows < row_end)[:, None]
        mask = row_mask & col_mask[None, :]
        rows = rows.to(tl.int64)[:, None]
        xf = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        x_next, dy_next = _load_x_and_grad(x_ptr, grad_out_ptr, first + ROWS + offs, row_end, cols, col_mask,
                                           x_stride, grad_out_stride)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)[:, None]
        xhat = xf * rstd
        g = dy * scale
        if WEIGHT_GRAD:
            if ROUND_BEFORE_WEIGHT:
                contrib = dy * xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
            else:
                contrib = dy * xhat
            # Rows past the end hold 0 * rsqrt(eps), which is NaN when eps == 0.
            dw_acc += tl.sum(tl.where(row_mask, contrib, 0.0), axis=0)
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=1) / n_cols)[:, None])
        if HAS_GRAD_SUM:
            dx += tl.load(grad_sum_ptr + rows * grad_sum_stride + cols[None, :], mask=mask, other=0.0,
                          eviction_policy="evict_first").to(tl.float32)
        tl.store(grad_x_ptr + rows * grad_x_stride + cols[None, :], dx.to(grad_x_ptr.dtype.element_ty),
                 mask=mask, eviction_policy="evict_first")
    if WEIGHT_GRAD:
        tl.store(partial_ptr + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)


@triton.jit
def _backward_looped_kernel(
    grad_out_ptr, x_ptr, weight_ptr, grad_sum_ptr, grad_x_ptr, partial_ptr,
    n_rows, n_cols, rows_per_program, grad_out_stride, x_stride, grad_sum_stride, grad_x_stride,
    eps, offset,
    BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, HAS_GRAD_SUM: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
):
    """`_backward_kernel` for rows wider than a register block: per row, one pass for sum(x^2) and
    sum(g * x), a second for dx; the dw partial sums live in this program's row of `partial` (zeroed)."""
    pid = tl.program_id(0)
    partial_row = partial_ptr + pid.to(tl.int64) * n_cols
    row_start = (pid * rows_per_program).to(tl.int64)
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
        sum_gx = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            xf = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            g = tl.load(grad_out_ptr + row * grad_out_stride + cols, mask=mask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            if HAS_WEIGHT:
                g *= _weight_scale(weight_ptr, cols, mask, offset, ROUND_BEFORE_WEIGHT)
            sum_sq += xf * xf
            sum_gx += g * xf
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
        mean_gxhat = tl.sum(sum_gx, axis=0) * rstd / n_cols
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            xhat = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0,
                           eviction_policy="evict_first").to(tl.float32) * rstd
            dy = tl.load(grad_out_ptr + row * grad_out_stride + cols, mask=mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            g = dy
            if HAS_WEIGHT:
                g = dy * _weight_scale(weight_ptr, cols, mask, offset, ROUND_BEFORE_WEIGHT)
            dx = rstd * (g - xhat * mean_gxhat)
            if HAS_GRAD_SUM:
                dx += tl.load(grad_sum_ptr + row * grad_sum_stride + cols, mask=mask, other=0.0,
                              eviction_policy="evict_first").to(tl.float32)
            tl.store(grad_x_ptr + row * grad_x_stride + cols, dx.to(grad_x_ptr.dtype.element_ty), mask=mask,
                     eviction_policy="evict_first")
            if WEIGHT_GRAD:
                if ROUND_BEFORE_WEIGHT:
                    contrib = dy * xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
                else:
                    contrib = dy * xhat
                acc = tl.load(partial_row + cols, mask=mask, other=0.0)
                tl.store(partial_row + cols, acc + contrib, mask=mask)
        # The next row's read-modify-write of `partial` must see this row's stores.
        tl.debug_barrier()


@triton.jit
def _sum_partials_kernel(partial_ptr, out_ptr, n_partials, n_cols,
                         BLOCK_COLS: tl.constexpr, BLOCK_PARTIALS: tl.constexpr):
    """out[c] = sum over p of partial[p, c], in a fixed order, so dw is deterministic."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_PARTIALS):
        rows = start + tl.arange(0, BLOCK_PARTIALS)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.sum(tl.load(partial_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask,
                              other=0.0), axis=0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def _row_block(n_cols: int) -> int:
    return triton.next_power_of_2(n_cols)


def config_path(device_name: str) -> pathlib.Path:
    """configs/<gpu>.json, the GPU's name in lower case with dashes ("NVIDIA H200" -> nvidia-h200.json)."""
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return CONFIG_DIR / f"{slug}.json"


@functools.lru_cache(maxsize=None)
def tuned_table(device_name: str) -> dict:
    """The GPU's table: {"device", "measured": [provenance], kind: {row block: launch}}, or {} without one."""
    path = config_path(device_name)
    return json.loads(path.read_text()) if path.exists() else {}


def heuristic_config(kind: str, block: int) -> dict:
    """A launch from the row block alone: 16 elements per thread forward (8 backward), several rows per
    program while a row is shorter than a 2048-element (1024) tile, 1 to 32 warps; the looped kernels above
    `_MAX_BLOCK`."""
    if block > _MAX_BLOCK[kind]:
        return {"looped": True, **_LOOPED[kind]}
    per_thread = 8 if kind == "backward" else 16
    rows = max(1, min(64, 128 * per_thread // block))
    launch = {"rows": rows, "num_warps": max(1, min(32, rows * block // (32 * per_thread)))}
    launch.update({"programs_per_sm": 2} if kind == "backward" else {"evict_first": True})
    return {"looped": False, "block": block, **launch}


@functools.lru_cache(maxsize=None)
def _note_heuristic(device_name: str, kind: str, block: int) -> None:
    """Say once per GPU, kind and row block that no tuned entry exists (the launch is `heuristic_config`'s)."""
    path = config_path(device_name)
    where = f"configs/{path.name}" if tuned_table(device_name) else f"no configs/{path.name}"
    logger.warning("rmsnorm: no tuned %s launch for row block %d on %s (%s); using the heuristic",
                   kind, block, device_name, where)


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str | None:
    """The GPU's name; None for CPU tensors (the Triton interpreter), which take the heuristic silently."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def launch_config(kind: str, n_cols: int, device: torch.device | None = None) -> dict:
    """The launch for `kind` ('forward', 'fused_add' or 'backward') at this hidden size on `device`:
    `{"looped": False, "block", "rows", "num_warps"[, "programs_per_sm" | "evict_first"]}` from the GPU's
    table, else `heuristic_config` (`"looped": True` where the row is wider than one block)."""
    block = _row_block(n_cols)
    name = _device_name(device) if device is not None else None
    entry = tuned_table(name).get(kind, {}).get(str(block)) if name else None
    if entry is not None:
        return {"looped": False, "block": block, **entry}
    if name:
        _note_heuristic(name, kind, block)
    return heuristic_config(kind, block)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _backward_programs(device: torch.device, n_rows: int, config: dict) -> int:
    if device.type == "cuda":
        target = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        target *= config["programs_per_sm"]
    else:
        target = _INTERPRETER_PROGRAMS
    return max(1, min(n_rows, target))


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _dependent_launch(device: torch.device) -> bool:
    """Whether the forward kernels launch as programmatic dependents: CUDA sm_90+, not the interpreter."""
    return (device.type == "cuda" and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"
            and _sm90_or_newer(device.index if device.index is not None else torch.cuda.current_device()))


def forward(x, residual, weight, out, sum_out, eps: float, offset: float, config: dict | None = None) -> None:
    """out = rmsnorm(x [+ residual]) and, with a residual, sum_out = x + residual. 2-D row views only;
    out and sum_out may alias x and residual (each element is read before it is written)."""
    n_rows, n_cols = x.shape
    config = config or launch_config("fused_add" if residual is not None else "forward", n_cols, x.device)
    has_residual = residual is not None
    args = (
        x, residual if has_residual else x, weight if weight is not None else x, out,
        sum_out if has_residual else out,
        n_rows, n_cols, x.stride(0), residual.stride(0) if has_residual else 0, out.stride(0),
        sum_out.stride(0) if has_residual else 0, eps, offset,
    )
    pdl = _dependent_launch(x.device)
    flags = dict(HAS_RESIDUAL=has_residual, HAS_WEIGHT=weight is not None, ROUND_BEFORE_WEIGHT=offset == 0.0,
                 PDL=pdl, launch_pdl=pdl)
    if config["looped"]:
        _forward_looped_kernel[(n_rows,)](*args, BLOCK=config["block"], num_warps=config["num_warps"], **flags)
    else:
        rows = config["rows"]
        _forward_kernel[(triton.cdiv(n_rows, rows),)](
            *args, BLOCK=config["block"], ROWS=rows, EVICT_FIRST=config["evict_first"], num_warps=config["num_warps"],
            **flags)


def backward(grad_out, x, weight, grad_sum, grad_x, grad_weight, eps: float, offset: float,
             config: dict | None = None) -> None:
    """grad_x (and grad_weight when given) of rmsnorm(x), plus grad_sum when given. 2-D row views."""
    n_rows, n_cols = x.shape
    config = config or launch_config("backward", n_cols, x.device)
    weight_grad = grad_weight is not None
    if n_rows == 0:
        if weight_grad:
            grad_weight.zero_()
        return
    n_programs = _backward_programs(x.device, n_rows, config)
    rows_per_program = triton.cdiv(n_rows, n_programs)
    n_programs = triton.cdiv(n_rows, rows_per_program)
    partial = None
    if weight_grad:
        alloc = torch.zeros if config["looped"] else torch.empty
        partial = alloc((n_programs, n_cols), dtype=torch.float32, device=x.device)
    has_grad_sum = grad_sum is not None
    args = (
        grad_out, x, weight if weight is not None else x, grad_sum if has_grad_sum else x, grad_x,
        partial if weight_grad else x,
        n_rows, n_cols, rows_per_program, grad_out.stride(0), x.stride(0),
        grad_sum.stride(0) if has_grad_sum else 0, grad_x.stride(0), eps, offset,
    )
    flags = dict(HAS_WEIGHT=weight is not None, WEIGHT_GRAD=weight_grad, HAS_GRAD_SUM=has_grad_sum,
                 ROUND_BEFORE_WEIGHT=offset == 0.0)
    if config["looped"]:
        _backward_looped_kernel[(n_programs,)](*args, BLOCK=config["block"], num_warps=config["num_warps"], **flags)
    else:
        _backward_kernel[(n_programs,)](
            *args, BLOCK=config["block"], ROWS=config["rows"], num_warps=config["num_warps"], **flags)
    if weight_grad:
        block_cols = min(256, _row_block(n_cols))
        _sum_partials_kernel[(triton.cdiv(n_cols, block_cols),)](
            partial, grad_weight, n_programs, n_cols, BLOCK_COLS=block_cols, BLOCK_PARTIALS=32, num_warps=4)
