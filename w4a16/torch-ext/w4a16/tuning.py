"""Launch configurations: tables tuned offline per GPU (``configs/<gpu>.json``, keyed by ``"NxK"`` and an M
bucket) and a heuristic for shapes and GPUs without one. Nothing is tuned at import or call time.

A config is a dict: ``{"kernel": "gemv", "block_n", "tiles", "split_k", "num_warps", "num_stages", "prefetch",
"half2"}`` (``half2``: run the packed-fp16 GEMV where it applies, see `half2_supported`;
``True`` with the same tiles, or a dict of its own ``block_n`` / ``tiles`` / ``split_k`` / ... overrides, where
``x_bcast`` loads x once per tile column and broadcasts it over the rows, and ``tma`` brings the weight tiles
in by TMA; with ``num_stages`` > 1 either is software-pipelined through shared memory; ``pdl_trigger``
``"start"`` lets the next dependent kernel launch right after the GEMV's wait instead of after its K loop;
``nf4_smem``: NF4 looked up in a 32 KB shared-memory table of value pairs, on by default, false for the PRMT
lookup (the dot path takes the 32 KB table or a 16 KB half one, whichever leaves its programs an SM as they are;
``nf4_table_copies`` 32 or 16 pins one); ``persistent``: at most that many programs an SM, each taking row blocks
in turn; ``maxnreg``: a cap on its registers a thread, `triton_kernels.launch._register_cap`),
``{"kernel": "dot", "block_m", "block_n", "split_k", "swap_ab", "full_tile", "packed",
"num_warps", "num_stages", "x_desc", "w_desc"}`` (``packed``: operands made by integer ops where the format allows,
see ``triton_kernels.dot._unit_pair``; ``x_desc`` / ``w_desc``: x and the weight words by TMA descriptors, where
x's rows are 16-byte aligned;
``nf4_tables``: NF4 operands by byte permutes rather than gathers, on by default where PTX runs;
``nf4_half_scale``: their group scales by packed fp16 multiplies, on by default; ``wgmma`` (in a dot or
dequant config): where `wgmma_supported`, run the Gluon kernel `triton_kernels.wgmma` instead, a dict of its
``block_m`` (tokens: at most 128, or 256 with one chain), ``block_n`` (rows: one or two dequantizing warpgroups
of ``chains`` 64-row chains, 2 by default), ``inflight``, ``num_stages`` (TMA ring of words and x), ``scales_tma``
(a K-tile's group parameters through the ring with its words; on unless False) and ``split_k`` (a count,
or ``"auto"``: chosen per call by `wgmma_tail_split`, whole waves of tiles unsplit and the rest split in a second
launch where that pays);
``mma``, in any config: where `mma_supported`, run the Gluon
tensor-core GEMV `triton_kernels.mma` for a few tokens, a dict of its ``block_m`` (8, 16, 32 or 64), ``num_warps``,
``reps`` (16-row blocks per warp), ``tiles`` (K-tiles per iteration), ``x_smem`` (x through shared memory),
``stages`` (a cp.async ring of that many slots for the words, x, scales and zero points, where
`cp_async_rows`, else one stage) and ``split_k``; NF4 looked up in the shared-memory pair table unless
``nf4_smem`` is false) or
``{"kernel": "dequant", "chunk_n"}`` (dequantize, then cuBLAS; optional ``block_n`` / ``tiles`` / ``num_warps``,
the dequantize kernel's programs, and ``nf4_tables`` as for dot, there also off for float32 activations). Any
config may also say ``"pdl": False``: the packed-fp16 and mma GEMVs and the dot kernel (and their split-K
reductions) then launch in stream order instead of as programmatic dependents of the kernel before
(`triton_kernels.launch.dependent_launch`, on by default where sm_90+ runs). And any config may hold a ``"bf16"``
dict: keys that replace its own when the activations are bf16 (`for_activations`), and an ``"nf4"`` dict: keys
that replace its own for NF4 weights (`nf4_tiles`: the ``wgmma`` tile, which NF4 does not take from the int4
config, and the decode kernels' ``half2`` / ``mma`` plans where NF4's were tuned apart).

A config says what to run where it applies; `resolve` turns it into the launch plan for one call's activation
dtype, device and weight format, the one place where those choices are made: ``"gemv"`` becomes
``"gemv_h2"`` (the packed-fp16 GEMV's own tiles merged in) or the portable ``"gemv"``; a dot or dequant config
with ``wgmma`` becomes ``"wgmma"`` where that kernel applies; a dot config's
``packed`` is kept only where the format allows it; with the SwiGLU epilogue the plan
says ``"swiglu": True`` and its row tiles pair gate and up rows. Launchers run a plan as it is.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
from pathlib import Path

import torch

from .formats import GATE_UP_BLOCK, PAD_N, TILE_K, round_up

logger = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# When a table has no "heuristic" section: the M ranges of each path.
DEFAULT_THRESHOLDS = {"gemv_max_m": 1, "dequant_min_m": 512}


def _slug(device_name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")


def table_path(device_name: str) -> Path:
    """Where the launch table of the GPU named `device_name` (as torch names it) is, or would be."""
    return CONFIG_DIR / f"{_slug(device_name)}.json"


@functools.lru_cache(maxsize=None)
def table(device_name: str) -> dict:
    path = table_path(device_name)
    return json.loads(path.read_text()) if path.exists() else {}


@functools.lru_cache(maxsize=None)
def device_info(device: torch.device) -> tuple[str, int]:
    """(name, SM count) of a device; the Triton interpreter on CPU tensors counts as a small GPU."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name, props.multi_processor_count
    return "interpreter", 4  # the Triton interpreter on CPU tensors: small grids


def tuned_config(tuned: dict, m: int, n: int, k: int) -> dict | None:
    """The config a launch table (`table`'s dict) holds for (N, K) at M: its smallest bucket >= M, else its
    largest; None where the shape has no entry."""
    entry = tuned.get("shapes", {}).get(f"{n}x{k}")
    if not entry:
        return None
    buckets = sorted(int(b) for b in entry)
    return entry[str(next((b for b in buckets if m <= b), buckets[-1]))]


def heuristic(m: int, n: int, k: int, sm_count: int, thresholds: dict | None = None, nf4: bool = False) -> dict:
    """A config from the problem size alone, shaped like the H200 sweep's winners: enough programs to fill
    the GPU (split-K when N is small), one K=128 dot per tile with the weight rows as the MMA's M, packed
    operands, 4 warps; `nf4`: for NF4 weights (their own long-row threshold at one token)."""
    limits = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    rows = round_up(n, PAD_N)
    tiles = round_up(k, TILE_K) // TILE_K
    if m <= limits["gemv_max_m"]:
        block_n = 8  # few rows and many K-tiles per program won on every H200 shape
        per_iter = min(32, 1 << (tiles.bit_length() - 1))
        programs = rows // block_n
        split = 1 if programs >= 2 * sm_count else min(-(-2 * sm_count // programs), max(1, tiles // per_iter))
        # half2: the packed-fp16 GEMV's tiles where it applies (`half2_supported`: NVIDIA, most formats), else
        # the fp32 GEMV's. On the H200 (2026-12-01) 8 rows x 8 tiles per program won on 9 of 12 decode shapes
        # (the least registers, so the most warps in flight), split-K where it keeps >= 16 tiles per split and
        # at most 8 programs per SM (Qwen2.5-1.5B down 4, Llama-3-8B down 2).
        h2_split = max(s for s in (1, 2, 4, 8) if s == 1 or (programs * s <= 8 * sm_count and tiles // s >= 16))
        half2 = {"block_n": 8, "tiles": 8, "split_k": h2_split, "num_warps": 4, "prefetch": False}
        if k >= (4096 if nf4 else 8192) and n >= 4096:
            # Long rows: x broadcast over 16 rows, a 3-stage TMA ring of the weight tiles, 2 warps (127 registers,
            # the most words per thread), no split; on the H200 (2026-12-01, docs/design/w4a16.md E1c) 6-29 %
            # faster on the four Llama-3-70B shapes and Llama-2-7B down, even on Llama-3-8B down; shapes with
            # K <= 4096 or few rows (Qwen2.5-1.5B down) lost 10-30 % with it. NF4 (its pair table filled once a
            # program, E73) from K = 4096: on the H200 (run 180) 1.21-1.24x on Llama-3-8B qkv / o and Llama-2-7B
            # gate_up, a tie on 8B gate_up / down; the Qwen2.5-1.5B shapes (K = 1536) lost 15-25 %.
            half2 = {"block_n": 16, "tiles": 8, "split_k": 1, "num_warps": 2, "prefetch": False, "num_stages": 3,
                     "x_bcast": True, "tma": True}
        return {"kernel": "gemv", "block_n": block_n, "tiles": per_iter, "split_k": split,
                "num_warps": 4, "num_stages": 1, "half2": half2}
    if m >= limits["dequant_min_m"]:
        return {"kernel": "dequant", "chunk_n": 4096 if m >= 1024 else 0, **_wgmma_heuristic(m, rows, k)}
    if m <= 16:
        block_m, block_n = 16, 64
    elif m <= 64:
        # On the H200 (2026-12-01, docs/design/w4a16.md E2b) 128 weight rows per program won with long K or many
        # rows, 64 elsewhere: within 10 % of the best measured tile on 10 shapes (geomean 0.99).
        block_m, block_n = 64, 128 if k >= 8192 or n >= 24576 else 64
    else:
        block_m, block_n = 128, 64
    programs = -(-m // block_m) * (rows // block_n)
    # split-K to about two programs per SM, as a power of two: on the H100 table (run 165) every tuned split at
    # M = 17-64 was the power of two nearest that count, and the unrounded 3 / 5 / 9 ran 13-20 % slower (8B qkv,
    # 70B o / down, 8B down at M = 64)
    split = 1 if programs >= sm_count else min(_nearest_pow2(-(-2 * sm_count // programs)),
                                               _nearest_pow2(max(1, tiles // 4), below=True))
    # x and the weight words by TMA from M = 17 up: 7-16 % faster at M = 64-256, a loss at M = 16 (E2, E2b)
    config = {"kernel": "dot", "block_m": block_m, "block_n": block_n, "split_k": split, "swap_ab": True,
              "full_tile": True, "packed": True, "num_warps": 4, "num_stages": 3, "x_desc": m > 16, "w_desc": m > 16}
    if m <= 32:
        config["mma"] = mma_heuristic(m, rows, tiles, sm_count)
    return {**config, **_wgmma_heuristic(m, rows, k)}


def _nearest_pow2(count: int, below: bool = False) -> int:
    """The power of two nearest `count` (>= 1) on a log scale, or with `below` the largest one <= count."""
    low = 1 << (count.bit_length() - 1)
    return low if below or count * count < 2 * low * low else 2 * low


def _wgmma_heuristic(m: int, rows: int, k: int) -> dict:
    """The wgmma tile of an untuned shape (Hopper, `wgmma_supported`; elsewhere the config it sits in runs): 256
    rows with the split chosen per call (`wgmma_split`), from 257 tokens (129 where K >= 8192) on weights of 16M or
    more (N x K) whose padded rows it divides. On the H100 table it won at M = 512-1024 on every Llama-3 shape but
    8B qkv at 1024 (runs 115-117), and on the untuned shapes timed beside it at fixed splits (runs 115 / 117, the
    model's split) 1.09-1.57x the dot / dequantize heuristic on Llama-2-7B gate_up / down and Qwen2.5-1.5B gate_up
    at M = 384-1024 (one tie, 0.995); at M = 256 it lost on the gate_up shapes (K 1536-4096: 0.85-0.97) and won on
    Llama-2-7B down (K 11008: 1.49x), as the table took it at M = 256 on every Llama-3 shape with K >= 8192; on the
    small Qwen2.5-1.5B o / qkv / down (2-14M weights) it lost at every M. docs/design/w4a16.md E44. Since its
    persistent programs and TMA stores (E49 / E50, run 136) it also beat dequantize + cuBLAS at M = 2048 / 4096 on
    Llama-2-7B down (1.13x / 1.03x) and Qwen2.5-1.5B gate_up (1.29x / 1.22x)."""
    if (128 if k >= 8192 else 256) < m and rows % 256 == 0 and rows * k >= 1 << 24:
        return {"wgmma": {"block_m": 128, "block_n": 256, "num_stages": 3, "inflight": 2, "split_k": "auto"}}
    return {}


def mma_heuristic(m: int, rows: int, tiles: int, sm_count: int) -> dict:
    """The mma GEMV's launch for 2-32 tokens where no table entry exists (formats it does not take run the config
    it sits in). On the H200 (2026-12-02, docs/design/w4a16.md E15, 8 Llama-3 shapes) 4 K-tiles per iteration in a
    2-stage ring on 4 warps was the best or within 5 % of it on 6 of 8 shapes at 4-8 tokens; 17-32 tokens take one
    32-token tile, 2 K-tiles in a 3-stage ring (E17: on 6 untuned shapes 1.08x cuBLAS against the dot
    heuristic's 0.90x, 3-4 % slower only on Qwen2.5-1.5B qkv / o). Split-K until there are two programs per SM,
    keeping 8 K-tiles or more per split."""
    programs = rows // 64
    split = next((s for s in (1, 2, 4) if programs * s >= 2 * sm_count), 4)
    while split > 1 and tiles // split < 8:
        split //= 2
    if m > 16:
        return {"block_m": 32, "num_warps": 4, "tiles": 2, "stages": 3, "split_k": split}
    return {"num_warps": 4, "tiles": 4, "stages": 2, "split_k": split}


def select(m: int, n: int, k: int, device: torch.device, nf4_group: int | None = None) -> dict:
    """The tuned config for (N, K) and M's bucket on this GPU, else the heuristic; for NF4 weights (`nf4_group`:
    their group size) with their own tensor-core tiles (`nf4_tiles`)."""
    name, sm_count = device_info(device)
    tuned = table(name)
    config = tuned_config(tuned, m, n, k)
    if config is None:
        if device.type != "cpu":
            _note_heuristic(name, n, k)
        config = heuristic(m, n, k, sm_count, tuned.get("heuristic"), nf4=nf4_group is not None)
    if nf4_group is not None:
        return nf4_tiles(config, m, n, sm_count, nf4_group)
    if "nf4" not in config:  # no copy on the common path: select runs on every call
        return config
    return {key: value for key, value in config.items() if key != "nf4"}


@functools.lru_cache(maxsize=None)
def _note_heuristic(device_name: str, n: int, k: int) -> None:
    """Say once per GPU and shape that no tuned table entry exists (the launch then comes from `heuristic`)."""
    name = table_path(device_name).name
    where = f"configs/{name}" if table(device_name) else f"no configs/{name}"
    logger.warning("w4a16: no tuned launch config for N x K = %d x %d on %s (%s); using the heuristic",
                   n, k, device_name, where)


def nf4_tiles(config: dict, m: int, n: int, sm_count: int, group_size: int) -> dict:
    """An int4 config made NF4's (`_nf4_int4_tiles`), then the entry's ``"nf4"`` keys. NF4 does not take the int4
    config's ``wgmma`` tile: its codebook lookup costs a dequantized operand more instructions than int4's (1.19x
    in the K loop's SASS; by byte permutes it was issue-bound at 0.69x int4's time, docs/design/w4a16.md E42).
    Where the int4 config has one at 129-1024 tokens, NF4 takes `NF4_WGMMA` instead: one 64-row chain a
    warpgroup on 256 tokens, which dequantizes each weight half as often (E79). The table's ``"nf4"`` keys
    (`merge_compare` of NF4 results) name other tiles per shape."""
    override = config.get("nf4", {})
    int4 = {key: value for key, value in config.items() if key not in ("wgmma", "nf4")}
    nf4 = _nf4_int4_tiles(int4, m, n, sm_count, group_size)
    if "wgmma" in config and 128 < m <= NF4_WGMMA_MAX_M:
        nf4 = {**nf4, "wgmma": NF4_WGMMA}
    return {**nf4, **override}


# NF4's wgmma tile (`nf4_tiles`, E79). On the H100 (run 190, NF4 g64, fp16 x, the 8 Llama-3 shapes, with E80's
# scales through the ring): at M = 1024 1.04-1.33x dequantize + cuBLAS, which the table ran there (0.92-1.03x
# cuBLAS fp16); at M = 256 1.13-1.40x the 128 x 256 tile the table named (0.99x on 8B o). At M = 4096 its 2-stage
# ring starves (int4: 0.80-0.86x the 128 x 256 tile, run 147), so from 1025 tokens NF4 dequantizes.
NF4_WGMMA = {"block_m": 256, "block_n": 128, "num_stages": 2, "inflight": 2, "chains": 1, "split_k": "auto"}
NF4_WGMMA_MAX_M = 1024


def _nf4_int4_tiles(config: dict, m: int, n: int, sm_count: int, group_size: int) -> dict:
    """An int4 tensor-core config made NF4's. The NF4 operands cross shared memory after their byte-permute
    lookup (`triton_kernels.nf4`), and on the H200 (2026-12-01, docs/design/w4a16.md E3, 4 shapes, groups of 64)
    8-warp tiles beat the int4 ones: 128 weight rows on 8 warps up to M = 64 (8-18 % faster), 256 tokens x 128
    rows above (20-55 %), split-K 2 where that leaves less than one wave; where the waves of that grid leave many
    SMs idle (`NF4_MIN_WAVE_USE`), dequantize + cuBLAS. The large tile only where the group
    scales go on the operands: with a scale per whole tile (groups of 128 and more) it needs a second 256 x 128
    accumulator, spills and overflows shared memory.

    An mma entry with two 16-row blocks per warp (``reps`` 2, tuned on int4, where it halves x's shared-memory
    reads) loses 20-50 % with NF4, whose lookup is integer-issue bound (docs/design/w4a16.md E17, run 47): NF4
    takes the same rows on reps-1 warps (up to 4), the launch run 45 measured for NF4 on those shapes."""
    mma = config.get("mma")
    if mma and mma.get("reps", 1) > 1:
        warps, reps = mma.get("num_warps", 4), mma["reps"]
        config = {**config, "mma": {**mma, "num_warps": min(4, warps * reps), "reps": 1}}
    if config["kernel"] != "dot" or m <= 16:
        return config
    if m <= 64 or (group_size != -1 and group_size % 128 == 0):
        return {**config, "num_warps": 8} if config["block_n"] >= 128 else config
    programs = -(-m // 256) * (round_up(n, PAD_N) // 128)
    split = 2 if programs < sm_count else 1
    if _wave_use(programs * split, sm_count) < NF4_MIN_WAVE_USE:
        return {"kernel": "dequant", "chunk_n": 0}
    # x and the words by TMA whatever the int4 entry says: on the H200 (E21, run 66) 1.26-1.37x on the two
    # Llama-3-70B shapes whose int4 entries load them by pointers
    return {**config, "block_m": 256, "block_n": 128, "num_warps": 8, "split_k": split, "x_desc": True,
            "w_desc": True}


# NF4 at 65-511 tokens: below this share of SM slots busy over the 256 x 128 tile grid's waves, dequantize +
# cuBLAS wins. On the H200 (docs/design/w4a16.md E21, run 65, 8 Llama-3 shapes at M = 256, groups of 64) the four
# shapes under 0.8 (0.48-0.73) ran 1.14-1.61x faster that way; of the four above (0.85-0.97) three ran 7-24 %
# slower, one 2 % faster.
NF4_MIN_WAVE_USE = 0.8


def _wave_use(programs: int, sm_count: int) -> float:
    """The share of SM slots a grid of `programs` one-per-SM programs keeps busy over its waves."""
    return programs / (-(-programs // sm_count) * sm_count)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def packed_dot_supported(codebook, group_size, has_mins: bool = False) -> bool:
    """Whether the dot path can build its operands by integer ops (`triton_kernels.dot._unit_planes`): int4
    with whole-tile or per-channel groups and integer (or no) zero points."""
    return codebook is None and not has_mins and (group_size == -1 or group_size % 128 == 0)


def half2_supported(x, codebook, group_size, has_mins: bool = False, has_zeros: bool = False) -> bool:
    """Whether the packed-fp16 GEMV (`_gemv_h2_kernel`) applies: fp16 activations (bf16 after
    `_x_to_fp16_kernel`), int4 or NF4 with scale groups of whole 128-column tiles or per channel, NF4 groups of
    64, int4 groups of 32 or 64 without integer zero points (symmetric, or float minima: GGUF's layout), on an
    NVIDIA GPU (inline PTX) or the interpreter (emulated). Elsewhere (NF4 groups of 32, int4 groups of 32 or 64
    with zero points, minima per channel, ROCm, XPU) a GEMV config runs the portable `_gemv_kernel`."""
    whole_tiles = group_size == -1 or group_size % 128 == 0
    if codebook is not None:
        groups_ok = whole_tiles or group_size == 64
    else:
        groups_ok = (whole_tiles or (group_size in (32, 64) and not has_zeros)) and not (has_mins and group_size == -1)
    if x.dtype not in (torch.float16, torch.bfloat16) or not groups_ok:
        return False
    return interpreting() or (x.device.type == "cuda" and torch.version.hip is None)


def wgmma_supported(x, codebook, group_size, swiglu: bool = False) -> bool:
    """Whether the Gluon tensor-core kernel (`triton_kernels.wgmma`) applies: a Hopper GPU
    (wgmma is sm_90a only), fp16 / bf16 activations whose rows TMA can read (16-byte aligned), int4 or NF4 with
    scale groups of 32, 64, multiples of 128 or per channel, no SwiGLU epilogue. Elsewhere its config runs as the
    dot or dequantize config it sits in."""
    return (_gluon_applies(x, group_size, swiglu, "wgmma") and torch.cuda.get_device_capability(x.device) == (9, 0)
            and tma_rows(x))


# `wgmma_split`'s cost of a split-K reduction, in tile steps (one K-tile of one program: 1.2-2 us on the H100): its
# fp32 partials written and read back, at ~5 MB of traffic per step, and ~3 steps for its launch. Fitted on the
# H100 (docs/design/w4a16.md E43, `hubtools.bench.w4a16.wgmma_split_regret`): on 170 measured (shape, M, tile)
# groups with two or more of splits 1 / 2 / 4 (runs 114-122: int4 and NF4, 128- and 256-row tiles, tuned and
# untuned shapes, M = 64-4096) its pick ran within 3.6 % of the fastest split, 0.1 % in geomean; anywhere in
# 4-6 MB and 2-4 steps it stays so.
WGMMA_SPLIT_BYTES_PER_STEP = 5e6
WGMMA_SPLIT_LAUNCH_STEPS = 3
# The split counts `wgmma_split` weighs. 3 joined 1 / 2 / 4 after a sweep of all four on ten shapes at M = 256 / 512
# (H100, run 151, E59): weighing it, the model picked the fastest measured split in all 20 groups (regret 1.0001 in
# geomean, 1.001 at most) against 1.0034 and 1.069 without it (Llama-3-70B qkv at M = 256: 80 tiles, two waves of
# 40 unsplit; 240 parts in two of 120 at split 3, 75.2 against 80.4 us).
WGMMA_SPLITS = (1, 2, 3, 4)
# `wgmma_tail_split` takes two launches only where the model says they save more than this share of one launch's
# steps: the model's picks ran within 3.6 % of the fastest split (above), so a smaller saving is within its error.
WGMMA_TAIL_MIN_GAIN = 0.03


def _wgmma_launch_steps(programs: int, m: int, n: int, tiles: int, split: int, sm_count: int) -> float:
    """One wgmma launch's tile steps on the critical path: its waves of one-per-SM programs (`programs` tiles,
    each in `split` parts) times the K-tiles of a part, plus the reduction of a split (its partials of ``m x n``
    written and read back, and its own launch)."""
    waves = -(-programs * split // sm_count)
    reduction = m * n * (8 * split + 2) / WGMMA_SPLIT_BYTES_PER_STEP + WGMMA_SPLIT_LAUNCH_STEPS
    return waves * -(-tiles // split) + (reduction if split > 1 else 0)


def wgmma_split(m: int, n: int, k: int, block_m: int, block_n: int, sm_count: int) -> int:
    """The split-K count (one of WGMMA_SPLITS) of the wgmma kernel's fewest tile steps on the critical path: the
    waves of one-per-SM programs times the K-tiles each program runs, plus the reduction's cost for a split. A program
    holds an SM (232 registers a consumer thread), and its steps take about the same time whatever M, so the grid's
    waves decide: M = 640 on Llama-3-70B down is 160 programs of 224 K-tiles (two waves, the second 21 % full)
    unsplit, 640 programs of 56 in five waves at split 4."""
    programs = -(-m // block_m) * -(-n // block_n)
    tiles = -(-k // TILE_K)
    return min(WGMMA_SPLITS, key=lambda split: _wgmma_launch_steps(programs, m, n, tiles, split, sm_count))


@functools.lru_cache(maxsize=None)
def wgmma_tail_split(m: int, n: int, k: int, block_m: int, block_n: int, sm_count: int) -> tuple[int, int]:
    """``(columns, split)`` for ``"split_k": "auto"``: the first `columns` row-tile columns run unsplit in one
    launch and the others in `split` parts in a second launch with its reduction, where that has fewer tile steps
    (`_wgmma_launch_steps` of each launch, the second's launch ramp counted too) than `wgmma_split`'s one launch by
    more than `WGMMA_TAIL_MIN_GAIN`. Whole waves stay unsplit, so only the tiles a partial last wave would leave
    idle pay for a reduction: Llama-3-70B qkv at M = 512 is 160 tiles on 132 SMs, 132 of them (33 columns) whole
    and 28 in quarters (1.27x faster than `wgmma_split`'s one launch on the H100, docs/design/w4a16.md E48). One
    launch is ``(0, split)``, or ``(all columns, 1)`` unsplit."""
    token_tiles, columns = -(-m // block_m), -(-n // block_n)
    tiles = -(-k // TILE_K)
    whole = wgmma_split(m, n, k, block_m, block_n, sm_count)
    best = (0, whole) if whole > 1 else (columns, 1)
    # the steps two launches must come under: one launch's, less the minimum gain, then the best pair's so far
    bar = _wgmma_launch_steps(token_tiles * columns, m, n, tiles, whole, sm_count) * (1 - WGMMA_TAIL_MIN_GAIN)
    for first in range(1, columns):
        rest = (columns - first) * block_n
        for split in (2, 4):  # the second launch's splits measured (E48); 3 there has not been timed
            steps = (_wgmma_launch_steps(token_tiles * first, m, first * block_n, tiles, 1, sm_count)
                     + _wgmma_launch_steps(token_tiles * (columns - first), m, rest, tiles, split, sm_count)
                     + WGMMA_SPLIT_LAUNCH_STEPS)
            if steps < bar:
                best, bar = (first, split), steps
    return best


def mma_supported(x, codebook, group_size, swiglu: bool = False, has_mins: bool = False) -> bool:
    """Whether the Gluon tensor-core GEMV (`triton_kernels.mma`) applies: an NVIDIA GPU of sm_80 or later
    (`mma.sync`), fp16 / bf16 activations, int4 with integer or symmetric zero points or NF4, scale groups of 32,
    64, multiples of 128 or per channel, no SwiGLU epilogue. Elsewhere its config runs as the config it sits in."""
    return (_gluon_applies(x, group_size, swiglu, "mma") and not has_mins
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def _gluon_applies(x, group_size, swiglu: bool, module: str) -> bool:
    """What both Gluon kernels need: an NVIDIA GPU with the Triton build's Gluon ops of `module`, fp16 / bf16
    activations, scale groups of 32, 64, multiples of 128 or per channel, no SwiGLU epilogue."""
    if interpreting() or x.device.type != "cuda" or torch.version.hip is not None or not _gluon_available(module):
        return False
    groups_ok = group_size == -1 or group_size % 128 == 0 or group_size in (32, 64)
    return x.dtype in (torch.float16, torch.bfloat16) and groups_ok and not swiglu


def cp_async_rows(x: torch.Tensor) -> bool:
    """Whether the mma kernel's cp.async ring can copy x in 16-byte pieces: unit column stride, and a row stride
    and width of multiples of 16 elements (Triton proves alignment only from multiples of 16) on a 16-byte aligned
    base; otherwise its lowering needs 2-byte copies, which cp.async does not have."""
    return (x.stride(-1) == 1 and x.stride(0) % 16 == 0 and x.shape[-1] % 16 == 0 and x.data_ptr() % 16 == 0)


def tma_rows(x: torch.Tensor) -> bool:
    """Whether TMA descriptors can read x's rows: unit column stride, rows and base 16-byte aligned."""
    return x.stride(-1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0


# Triton releases (major.minor) whose Gluon API the Gluon kernels (`triton_kernels.mma`, `triton_kernels.wgmma`,
# and `warp_specialize`'s PTX edit) were written and GPU-tested against. Gluon is experimental and changes between
# releases: Triton 3.9 removed `tma.async_copy_global_to_shared` / `async_copy_shared_to_global`, which both kernels
# call, so their compile fails there, and releases after 3.6 call the stage hook `unlooped_workers` sets with no
# arguments (for a cache key), which it does not take. On any other release the plans fall back to the
# Triton-language kernels.
GLUON_TRITON_RELEASES = ("3.6",)


def gluon_release(triton_version: str) -> bool:
    """Whether a Triton of version `triton_version` (``"3.6.0"``) is a release the Gluon kernels were built for."""
    return ".".join(triton_version.split(".")[:2]) in GLUON_TRITON_RELEASES


@functools.lru_cache(maxsize=None)
def _gluon_available(module: str) -> bool:
    """Whether this Triton build has the Gluon ops that `triton_kernels.<module>` imports and is a release those
    kernels were tested on (`gluon_release`; elsewhere a warning, once, and the Triton-language kernels)."""
    import triton

    if not gluon_release(triton.__version__):
        logger.warning("w4a16: the Gluon kernels were built for Triton %s, this is Triton %s; running the "
                       "Triton-language kernels in place of triton_kernels.%s (slower at some M, same results)",
                       " / ".join(GLUON_TRITON_RELEASES), triton.__version__, module)
        return False
    try:
        importlib.import_module(f".triton_kernels.{module}", __package__)
    except ImportError:
        return False
    return True


def resolve(config: dict, x: torch.Tensor, codebook, group_size: int, swiglu: bool = False,
            has_mins: bool = False, has_zeros: bool = False) -> dict:
    """The launch plan of `config` for activations `x` and a weight of this format (`has_mins`: int4 with float
    minima, `has_zeros`: integer zero points; see the module doc); with `swiglu` (a fused gate / up weight in the
    SwiGLU layout) for the epilogue silu(gate) * up."""
    config = for_activations(config, x.dtype)
    plan = _kernel_plan(config, x, codebook, group_size, swiglu, has_mins, has_zeros)
    # the decode kernels' launch option and NF4 lookup (PRMT tables, warp shuffles or the shared-memory pair table),
    # set beside the kernel choice
    return {**plan, **{key: config[key] for key in ("pdl", "nf4_shfl", "nf4_smem") if key in config}}


def for_activations(config: dict, dtype: torch.dtype) -> dict:
    """`config` for activations of `dtype`: a ``"bf16"`` key holds keys that replace the config's own for bf16 x
    (a table entry tuned with fp16 x whose best launch differs for bf16, e.g. the mma GEMV, which takes bf16 as it
    is, where the packed-fp16 GEMV first converts x); other dtypes run the config without it."""
    if "bf16" not in config:
        return config
    if not isinstance(config["bf16"], dict):
        raise ValueError(f'a config\'s "bf16" must be a dict of keys for bf16 activations, got {config["bf16"]!r}')
    base = {key: value for key, value in config.items() if key != "bf16"}
    return {**base, **config["bf16"]} if dtype == torch.bfloat16 else base


def _kernel_plan(config: dict, x: torch.Tensor, codebook, group_size: int, swiglu: bool, has_mins: bool,
                 has_zeros: bool) -> dict:
    """`resolve` without the launch options."""
    if config.get("mma") and mma_supported(x, codebook, group_size, swiglu, has_mins):
        plan = {**config["mma"], "kernel": "mma"}
        if plan.get("stages", 1) > 1 and not cp_async_rows(x):
            # the cp.async ring copies x's rows in 16-byte pieces; other rows take the one-stage loop
            plan.update(stages=1, x_smem=True)
        return plan
    if config["kernel"] in ("dot", "dequant") and config.get("wgmma") and wgmma_supported(x, codebook, group_size,
                                                                                         swiglu):
        return {**config["wgmma"], "kernel": "wgmma"}
    plan = _format_plan(config, x, codebook, group_size, has_mins, has_zeros)
    if not swiglu:
        return plan
    if "block_n" in plan and plan["block_n"] < 2 * GATE_UP_BLOCK:
        # A program pairs gate row 16 b + i with up row 16 b + 8 + i (`formats.GATE_UP_BLOCK`), so it needs whole
        # 16-row blocks: the GEMVs' 8-row tiles become 16 (the dot tiles have 16 or more already), with half the
        # K-tiles per iteration so a thread holds as many words as the tuned tile (8 x 8 -> 16 x 4: 64 registers
        # for the packed-fp16 GEMV, where 16 x 8 takes 80; at M = 1 the fewest registers won, E1c). The
        # dequantize path applies the epilogue after its matmul, whatever its row chunks.
        widen = 2 * GATE_UP_BLOCK // plan["block_n"]
        plan["block_n"] *= widen
        if "tiles" in plan:
            plan["tiles"] = max(1, plan["tiles"] // widen)
    return {**plan, "swiglu": True}


def _format_plan(config: dict, x: torch.Tensor, codebook, group_size: int, has_mins: bool, has_zeros: bool) -> dict:
    """`resolve` for this activation dtype, device and weight format."""
    if config["kernel"] == "gemv":
        plan = {key: value for key, value in config.items() if key != "half2"}
        half2 = config.get("half2", False)
        if half2 and half2_supported(x, codebook, group_size, has_mins, has_zeros):
            plan.update(half2 if isinstance(half2, dict) else {}, kernel="gemv_h2")
        return plan
    # NF4 by byte permutes (inline PTX: NVIDIA, or emulated in the interpreter) unless a config says not
    ptx = x.device.type == "cuda" and torch.version.hip is None
    nf4_lookup = codebook is not None and bool(config.get("nf4_tables", True)) and (interpreting() or ptx)
    if config["kernel"] == "dequant":
        # from the codebook rounded to fp16, as the tensor-core path: not for float32 activations
        return {**config, "nf4_tables": nf4_lookup and x.dtype != torch.float32}
    if config["kernel"] == "dot":
        packed = bool(config.get("packed", False)) and packed_dot_supported(codebook, group_size, has_mins)
        # descriptors (TMA) need the full-tile paths and 16-byte aligned rows of x
        full_tile = packed or bool(config.get("full_tile", False))
        x_desc = bool(config.get("x_desc", False)) and full_tile and tma_rows(x)
        w_desc = bool(config.get("w_desc", False)) and full_tile
        nf4_tables = nf4_lookup and full_tile
        # packed fp16 multiplies of the looked-up pairs (fp16 activations; the launcher checks the scales' dtype)
        nf4_half_scale = nf4_tables and ptx and x.dtype == torch.float16 and bool(config.get("nf4_half_scale", True))
        return {**config, "packed": packed, "x_desc": x_desc, "w_desc": w_desc,
                "nf4_tables": nf4_tables, "nf4_half_scale": nf4_half_scale}
    return dict(config)
