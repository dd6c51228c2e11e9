"""w4a16 on the GPU at full size: every path against float64, compiled (fullgraph), in CUDA graphs.

References are float64 matmuls with the dequantized weight (the dequantization itself is checked against
the PyTorch reference). Outputs are poisoned with NaN before the kernels write them. Tolerances: the
result is rounded once to fp16 (2**-11 relative) or bf16 (2**-8); the dot and dequantize paths also
round dequantized weights to the activation dtype, so relative Frobenius errors stay under 1.5e-3 (fp16)
and 1e-2 (bf16).
"""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {torch.float16: 1.5e-3, torch.bfloat16: 1e-2}
FORMATS = [  # (fmt, zero_point, group_size)
    ("int4", False, 128),
    ("int4", True, 128),
    ("int4", False, 32),
    ("int4", True, 64),
    ("int4", False, -1),
    ("nf4", False, 64),
    ("nf4", False, 128),
    ("nf4", False, -1),
    ("int4", "float", 32),  # float minima in groups of 32: the layout GGUF Q4_1 / Q4_K imports take
    ("int4", "float", 128),
]


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("w4a16")


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _reference(k, x, qw, bias=None):
    weight = k.dequantize(qw, torch.float32).double()
    out = x.double() @ weight.t()
    return out if bias is None else out + bias.double()


def _check_launch(k, x, qw, bias, config):
    """One explicit launch on a NaN-poisoned output: every element written, within the dtype's tolerance of the
    float64 reference."""
    n, kk = qw.shape
    out = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=x.dtype)
    k.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, qw.codebook, bias, n, kk, qw.group_size, config,
                            out=out, mins=qw.mins)
    assert not out.isnan().any()
    assert _rel_err(out, _reference(k, x, qw, bias)) < TOL[x.dtype]


def _weight(n, kk, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, kk, device="cuda", dtype=dtype, generator=gen) * 0.05


@pytest.mark.parametrize("fmt,zero_point,group_size", [("int4", True, 64), ("int4", True, -1), ("nf4", False, 64)])
def test_dequantize_matches_pytorch_reference(k, fmt, zero_point, group_size):
    """The dequantize kernel, bit for bit, on poisoned outputs (K = 3136 ends inside a 128-column tile)."""
    qw = k.quantize(_weight(1000, 3136, torch.float16), group_size=group_size, zero_point=zero_point, fmt=fmt)
    ref = k.dequantize(qw.to("cpu"), torch.float32)
    out = torch.full((1000, 3136), float("nan"), device="cuda")
    k.triton_kernels.dequantize(qw.qweight, qw.scales, qw.zeros, qw.codebook, 1000, 3136, group_size, torch.float32,
                                out=out)
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("zero_point,group_size", [(False, 32), (True, 64), (True, 128), (False, 256), (True, -1),
                                                   (False, -1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_int4_pairs_match_pytorch_reference(k, zero_point, group_size, dtype):
    """int4 into fp16 / bf16 by packed pairs (the default there) equals the float32 planes rounded once, bit for
    bit; poisoned output, K = 3136 ending inside a 128-column tile where the group size allows."""
    kk = 3328 if group_size in (128, 256) else 3136
    qw = k.quantize(_weight(1000, kk, dtype), group_size=group_size, zero_point=zero_point)
    ref = k.dequantize(qw.to("cpu"), dtype)
    out = torch.full((1000, kk), float("nan"), device="cuda", dtype=dtype)
    k.triton_kernels.dequantize(qw.qweight, qw.scales, qw.zeros, None, 1000, kk, group_size, dtype, out=out)
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("variant", [{"stages": 3, "tiles": 8}, {"stages": 3, "tiles": 16, "w_desc": True},
                                     {"stages": 4, "tiles": 8, "block_n": 64}])
@pytest.mark.parametrize("fmt,zero_point,group_size", [("int4", True, 128), ("int4", False, -1), ("nf4", False, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_pipelined_variants_match_pytorch_reference(k, variant, fmt, zero_point, group_size, dtype):
    """The dequantize kernel's pipelined word loads (cp.async or TMA), bit for bit against PyTorch,
    on poisoned outputs: 1000 rows (not a multiple of the row tile), K ending inside a 128-column tile where the
    group size allows, tiles past the last K-tile in a program's range."""
    kk = 3328 if group_size == 128 else 3136
    qw = k.quantize(_weight(1000, kk, dtype), group_size=group_size, zero_point=zero_point, fmt=fmt)
    cpu = qw.to("cpu")
    codebook = None if cpu.codebook is None else cpu.codebook.half().float()
    ref = k.reference.dequantize(cpu.qweight, cpu.scales, cpu.zeros, None, codebook, None, 1000, kk, group_size, dtype)
    out = torch.full((1000, kk), float("nan"), device="cuda", dtype=dtype)
    k.triton_kernels.dequantize(qw.qweight, qw.scales, qw.zeros, qw.codebook, 1000, kk, group_size, dtype, out=out,
                                nf4_tables=True, **variant)
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("group_size", [64, 128, -1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_nf4_tables_use_the_fp16_codebook(k, group_size, dtype):
    """The matmul's NF4 dequantize (byte-permute tables; packed fp16 multiplies for fp16) equals the PyTorch
    dequantize with the codebook rounded to fp16, bit for bit (K = 3136 ends inside a 128-column tile where the
    group size allows)."""
    kk = 3328 if group_size == 128 else 3136
    qw = k.quantize(_weight(1000, kk, dtype), group_size=group_size, fmt="nf4")
    cpu = qw.to("cpu")
    ref = k.reference.dequantize(cpu.qweight, cpu.scales, None, None, cpu.codebook.half().float(), None, 1000, kk,
                                 group_size, dtype)
    out = torch.full((1000, kk), float("nan"), device="cuda", dtype=dtype)
    k.triton_kernels.dequantize(qw.qweight, qw.scales, None, qw.codebook, 1000, kk, group_size, dtype, out=out,
                                nf4_tables=True)
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("m", [1, 7, 16, 64, 256, 1024])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int4_g128_full_size(k, m, dtype):
    qw = k.quantize(_weight(6144, 4096, dtype), group_size=128)
    x = torch.randn(m, 4096, device="cuda", dtype=dtype)
    bias = torch.randn(6144, device="cuda", dtype=dtype)
    out = k.matmul(x, qw, bias)
    assert out.shape == (m, 6144) and out.dtype == dtype
    assert _rel_err(out, _reference(k, x, qw, bias)) < TOL[dtype]


@pytest.mark.parametrize("fmt,zero_point,group_size", FORMATS)
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_formats_non_power_of_two(k, fmt, zero_point, group_size, m):
    n, kk = 1000, 3200  # neither a power of two; K a multiple of every group size
    qw = k.quantize(_weight(n, kk, torch.float16, seed=1), group_size=group_size, zero_point=zero_point, fmt=fmt)
    x = torch.randn(3, m, kk, device="cuda", dtype=torch.float16)
    out = k.matmul(x, qw)
    assert out.shape == (3, m, n)
    assert _rel_err(out, _reference(k, x, qw)) < TOL[torch.float16]


CONFIGS = [
    {"kernel": "gemv", "block_n": 16, "tiles": 8, "split_k": 3, "num_warps": 4, "num_stages": 1},
    {"kernel": "gemv", "block_n": 16, "tiles": 8, "split_k": 2, "num_warps": 4, "num_stages": 1, "prefetch": True},
    {"kernel": "gemv", "block_n": 32, "tiles": 4, "split_k": 1, "num_warps": 8, "num_stages": 2},
    {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 4, "swap_ab": True, "num_warps": 4, "num_stages": 3},
    {"kernel": "dot", "block_m": 16, "block_n": 128, "split_k": 3, "swap_ab": True, "num_warps": 4, "num_stages": 3,
     "full_tile": True},
    {"kernel": "dot", "block_m": 64, "block_n": 128, "split_k": 1, "swap_ab": False, "num_warps": 8, "num_stages": 3},
    {"kernel": "dot", "block_m": 64, "block_n": 64, "split_k": 1, "swap_ab": False, "num_warps": 4, "num_stages": 3,
     "full_tile": True},
    {"kernel": "dequant", "chunk_n": 1024},
    {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 3, "swap_ab": True, "num_warps": 4, "num_stages": 3,
     "packed": True, "x_desc": True, "w_desc": True},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("zero_point", [False, True])
def test_explicit_configs_write_every_output(k, config, zero_point):
    """Each launch path, split-K included, on poisoned outputs (K = 5000: not a multiple of the 128 tile)."""
    n, kk, m = 3000, 5000, 5
    qw = k.quantize(_weight(n, kk, torch.bfloat16, seed=2), group_size=-1, zero_point=zero_point)
    x = torch.randn(m, kk, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    _check_launch(k, x, qw, bias, config)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("group_size", [32, 128])
def test_explicit_configs_with_minima(k, config, group_size):
    """Float minima on each launch path (configs that need integer zeros fall back inside `resolve`), K = 4992:
    groups of 32 and 128 that end inside the last 128-column tile for g32."""
    n, kk, m = 3000, 4992 if group_size == 32 else 5120, 5
    qw = k.quantize(_weight(n, kk, torch.float16, seed=3), group_size=group_size, zero_point="float")
    x = torch.randn(m, kk, device="cuda", dtype=torch.float16)
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    _check_launch(k, x, qw, bias, config)


HALF2_FORMATS = [(False, 128), (True, 128), (False, -1), (True, -1), (True, 256),  # (zero_point, group_size)
                 (False, 32), (False, 64), ("float", 32), ("float", 64), ("float", 128)]  # per-group sums (E11)


@pytest.mark.parametrize("zero_point,group_size", HALF2_FORMATS)
@pytest.mark.parametrize("tiles", [  # plain loads; x broadcast over the rows with a cp.async or a TMA ring
    {"block_n": 8, "split_k": 1, "prefetch": False}, {"block_n": 8, "split_k": 3, "prefetch": True},
    {"block_n": 16, "split_k": 3, "num_stages": 3, "x_bcast": True},
    {"block_n": 16, "split_k": 1, "num_stages": 3, "x_bcast": True, "tma": True},
    {"block_n": 16, "split_k": 3, "num_stages": 3, "x_bcast": True, "tma": True, "num_warps": 2}],
    ids=["plain", "split-prefetch", "bcast-cp-async-split", "bcast-tma", "bcast-tma-2warps-split"])
@pytest.mark.parametrize("dtype,x_scale", [(torch.float16, 1.0), (torch.float16, 3000.0), (torch.bfloat16, 1.0),
                                           (torch.bfloat16, 1e8)])
def test_half2_gemv_vs_float64(k, zero_point, group_size, tiles, dtype, x_scale):
    """The packed-fp16 GEMV (inline PTX) on poisoned outputs, against float64. Its fp16 products and 8-term
    partial sums add ~2^-11 relative rounding on top of the output's own, so TOL still holds; fp16 x in
    the thousands neither overflows nor loses accuracy, and bf16 x (made fp16 per tile by a pre-pass) works
    beyond fp16's range."""
    n, kk = 3000, 5120 if group_size != -1 else 5000  # per-channel: K not a multiple of the 128 tile
    qw = k.quantize(_weight(n, kk, dtype, seed=4), group_size=group_size, zero_point=zero_point)
    x = (torch.randn(2, kk, device="cuda") * x_scale).to(dtype)
    assert k.tuning.half2_supported(x, None, group_size, has_mins=zero_point == "float", has_zeros=zero_point is True)
    bias = torch.randn(n, device="cuda", dtype=dtype) * x_scale
    config = {"kernel": "gemv", "tiles": 8, "num_warps": 4, "half2": True, **tiles}
    _check_launch(k, x, qw, bias, config)


@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("tiles", [{"block_n": 8, "split_k": 1}, {"block_n": 16, "split_k": 3, "num_stages": 3,
                                                                  "x_bcast": True, "tma": True, "num_warps": 2}],
                         ids=["plain", "bcast-tma-2warps-split"])
def test_half2_gemv_any_uint8_zero_point(k, group_size, tiles):
    """The packed GEMV's zero-point pairs by integer arithmetic and one HADD2 (PTX) on zero points over all of
    uint8 (real checkpoints have 0-16), against float64 on a poisoned output."""
    n, kk = 3000, 5120
    gen = torch.Generator(device="cuda").manual_seed(21)
    groups = 1 if group_size == -1 else kk // group_size
    codes = torch.randint(0, 16, (n, kk), device="cuda", dtype=torch.uint8, generator=gen)
    zeros = torch.randint(0, 256, (groups, n), device="cuda", dtype=torch.uint8, generator=gen)
    scales = (torch.rand(groups, n, device="cuda", generator=gen) * 1e-3 + 1e-4).half()
    qw = k.formats.from_codes(codes, scales, zeros, group_size=group_size, fmt="int4", dtype=torch.float16)
    x = torch.randn(2, kk, device="cuda", dtype=torch.float16)
    size = kk // groups
    dense = ((codes.double() - zeros.double().repeat_interleave(size, 0).t())
             * scales.double().repeat_interleave(size, 0).t())
    out = torch.full((2, n), float("nan"), device="cuda", dtype=torch.float16)
    config = {"kernel": "gemv", "tiles": 8, "num_warps": 4, "half2": True, **tiles}
    k.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, None, None, n, kk, group_size, config, out=out)
    assert not out.isnan().any()
    assert _rel_err(out, x.double() @ dense.t()) < TOL[torch.float16]


PACKED_FORMATS = [(False, 128), (True, 128), (False, -1), (True, -1), (True, 256)]  # (zero_point, group_size)


@pytest.mark.parametrize("zero_point,group_size", PACKED_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_m,block_n,swap_ab,split_k,num_warps,num_stages,descs", [
    (16, 128, True, 3, 8, 3, False), (16, 64, True, 1, 8, 3, False), (64, 128, False, 1, 8, 3, False),
    (128, 128, True, 2, 8, 3, False), (16, 64, True, 2, 4, 3, True), (128, 64, True, 1, 4, 3, True),
    (128, 64, True, 2, 4, 3, True), (64, 128, True, 3, 8, 4, True)])
def test_packed_dot_vs_float64(k, zero_point, group_size, dtype, block_m, block_n, swap_ab, split_k, num_warps,
                               num_stages, descs):
    """The dot path on (code - zero) / 16 operands made by integer ops (x and the weight words by pointer loads
    or TMA descriptors) on poisoned outputs against float64; M = 37 leaves a partial token tile, K per channel is
    not a multiple of 128."""
    n, kk, m = 3000, 5120 if group_size != -1 else 5000, 37
    qw = k.quantize(_weight(n, kk, dtype, seed=6), group_size=group_size, zero_point=zero_point)
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    assert k.tuning.packed_dot_supported(None, group_size)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    config = {"kernel": "dot", "block_m": block_m, "block_n": block_n, "split_k": split_k, "swap_ab": swap_ab,
              "num_warps": num_warps, "num_stages": num_stages, "packed": True,
              "x_desc": descs, "w_desc": descs}
    assert k.tuning.resolve(config, x, None, group_size)["x_desc"] == descs
    _check_launch(k, x, qw, bias, config)


WGMMA_FORMATS = [("int4", False, 128), ("int4", True, 128), ("int4", True, 256), ("int4", False, -1),
                 ("int4", True, -1), ("int4", False, 32), ("int4", True, 64), ("int4", "float", 32),
                 ("int4", "float", 128), ("nf4", False, 64), ("nf4", False, 32), ("nf4", False, 128),
                 ("nf4", False, -1)]


WGMMA_TILES = {"128x128": {"block_m": 128, "num_stages": 4},
               "64x128-split3": {"block_m": 64, "num_stages": 4, "split_k": 3},
               "128x128-inflight2": {"block_m": 128, "num_stages": 3, "inflight": 2},
               "128x256-inflight2": {"block_m": 128, "block_n": 256, "num_stages": 3, "inflight": 2},
               "128x256-inflight3": {"block_m": 128, "block_n": 256, "num_stages": 3, "inflight": 3},
               "64x256-split3": {"block_m": 64, "block_n": 256, "num_stages": 4, "split_k": 3},
               "128x256-scales-loads": {"block_m": 128, "block_n": 256, "num_stages": 3, "inflight": 2,
                                        "scales_tma": False},
               "256x128-chains1": {"block_m": 256, "block_n": 128, "num_stages": 2, "inflight": 2, "chains": 1},
               "256x128-chains1-split2": {"block_m": 256, "block_n": 128, "num_stages": 2, "inflight": 2,
                                          "chains": 1, "split_k": 2},
               "256x64-chains1": {"block_m": 256, "block_n": 64, "num_stages": 3, "chains": 1}}


def _wgmma_case(k, fmt, zero_point, group_size, dtype, tiles, m):
    """M = 300 leaves a partial token tile (M = 64 a box larger than M), N = 3000 a partial row tile, K = 5000 (per
    channel) a partial K-tile that TMA zero-fills; many K-tiles, so every ring slot is reused many times."""
    n, kk = 3000, 5120 if group_size != -1 else 5000
    qw = k.quantize(_weight(n, kk, dtype, seed=8), group_size=group_size, zero_point=zero_point, fmt=fmt)
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    _check_wgmma(k, x, qw, bias, tiles)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma is Hopper's (sm_90a)")
@pytest.mark.parametrize("fmt,zero_point,group_size", WGMMA_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tiles", ["128x256-inflight2", "64x128-split3", "128x256-scales-loads", "256x128-chains1"])
def test_wgmma_formats_vs_float64(k, fmt, zero_point, group_size, dtype, tiles):
    """Every format and activation dtype through the Gluon kernel (a TMA loader warp beside warpgroups dequantizing
    into their register operand) on poisoned outputs against float64, on the two code paths a format meets: two
    consumer warpgroups with two chunks of MMAs in flight and TMA stores, and one consumer with one chunk in flight
    writing fp32 split parts (`_wgmma_case`); the first also with "scales_tma" off (by default a K-tile's group
    rows come through the ring by TMA: one for g >= 128 and per channel, 2 / 4 for groups of 64 / 32); and two
    warpgroups of one 64-row chain each on 256 tokens ("chains": 1, MMAs of N = 256)."""
    _wgmma_case(k, fmt, zero_point, group_size, dtype, WGMMA_TILES[tiles], 300)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma is Hopper's (sm_90a)")
@pytest.mark.parametrize("fmt,zero_point,group_size,dtype", [("int4", True, 128, torch.float16),
                                                             ("int4", "float", 32, torch.bfloat16),
                                                             ("nf4", False, 64, torch.bfloat16)])
@pytest.mark.parametrize("tiles", list(WGMMA_TILES))
@pytest.mark.parametrize("m", [64, 300])
def test_wgmma_tiles_vs_float64(k, fmt, zero_point, group_size, dtype, tiles, m):
    """Every tile at a partial token tile and at one smaller than the tile (`_wgmma_case`), with an int4 zero-point,
    an int4 float-minimum g32 and an NF4 g64 weight (formats x tiles: `test_wgmma_formats_vs_float64`)."""
    _wgmma_case(k, fmt, zero_point, group_size, dtype, WGMMA_TILES[tiles], m)


def _check_wgmma(k, x, qw, bias, tiles):
    """`_check_launch` of the wgmma tiles `tiles`, and the same bits from a second launch (a race between the
    partitions would move the result between launches)."""
    (m, kk), n = x.shape, qw.shape[0]
    config = {**k.tuning.heuristic(m, n, kk, 132), "wgmma": tiles}
    assert k.tuning.resolve(config, x, qw.codebook, qw.group_size, has_mins=qw.mins is not None,
                            has_zeros=qw.zeros is not None)["kernel"] == "wgmma"
    _check_launch(k, x, qw, bias, config)
    first, second = (k.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, qw.codebook, bias, n, kk,
                                             qw.group_size, config, mins=qw.mins) for _ in range(2))
    assert torch.equal(first, second)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma is Hopper's (sm_90a)")
@pytest.mark.parametrize("fmt,zero_point,group_size,dtype", [("int4", True, 128, torch.float16),
                                                             ("int4", False, 32, torch.bfloat16),
                                                             ("nf4", False, 64, torch.bfloat16)])
@pytest.mark.parametrize("m,tiles", [(2000, {"block_m": 64, "block_n": 256, "num_stages": 3, "inflight": 2}),
                                     (1000, {"block_m": 128, "block_n": 128, "num_stages": 4, "split_k": 2}),
                                     (700, {"block_m": 128, "block_n": 256, "num_stages": 3, "inflight": 2,
                                            "split_k": "auto"}),
                                     (1000, {"block_m": 128, "block_n": 256, "num_stages": 3, "inflight": 2,
                                             "split_k": 3})],
                         ids=["2000-64x256", "1000-128x128-split2", "700-128x256-auto", "1000-128x256-split3"])
@pytest.mark.parametrize("n", [3000, 2998], ids=["tma-stores", "pointer-stores"])
def test_wgmma_blocks_after_blocks_vs_float64(k, fmt, zero_point, group_size, dtype, m, tiles, n):
    """Persistent programs, each running several output blocks one after the other on one ring (2000 tokens: 32
    token tiles x 12 row tiles on 132 programs; 8 x 24 x 2 split parts; the tail split's two launches), K = 4480
    (35 K-tiles, so the ring's slot and phase at a block's start vary), with a bias, on poisoned outputs against
    float64; the unsplit outputs by TMA stores whose buffers are reused block after block, or by pointer stores
    where an output row is not 16-byte aligned (N = 2998); the split parts' fp32 sums likewise by TMA stores into
    parts padded to whole token tiles (1000 tokens: the last tile's box reaches past M), or by pointer stores where
    N is not a multiple of 4."""
    kk = 4480
    qw = k.quantize(_weight(n, kk, dtype, seed=10), group_size=group_size, zero_point=zero_point, fmt=fmt)
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    _check_wgmma(k, x, qw, bias, tiles)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma is Hopper's (sm_90a)")
@pytest.mark.parametrize("fmt,zero_point,group_size,dtype", [("int4", True, 128, torch.float16),
                                                             ("nf4", False, 64, torch.bfloat16)])
@pytest.mark.parametrize("m,split", [(64, 4), (300, 3), (512, 2), (700, 1)])
def test_wgmma_auto_split_vs_float64(k, fmt, zero_point, group_size, dtype, m, split):
    """``"split_k": "auto"`` where it is one launch: `tuning.wgmma_split`'s choice (here each of 1, 2, 3 and 4) on
    poisoned outputs against float64."""
    n, kk = 3000, 5120
    assert k.tuning.wgmma_split(m, 3072, kk, 128, 256, 132) == split
    assert k.tuning.wgmma_tail_split(m, 3072, kk, 128, 256, 132) == (0 if split > 1 else 12, split)
    qw = k.quantize(_weight(n, kk, dtype, seed=8), group_size=group_size, zero_point=zero_point, fmt=fmt)
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    _check_wgmma(k, x, qw, None, {"block_m": 128, "block_n": 256, "num_stages": 3, "inflight": 2,
                                  "split_k": "auto"})


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                    or torch.cuda.get_device_properties(0).multi_processor_count != 132,
                    reason="wgmma is Hopper's (sm_90a); the picks are a 132-SM card's")
@pytest.mark.parametrize("fmt,zero_point,group_size,dtype", [("int4", True, 128, torch.float16),
                                                             ("int4", False, -1, torch.bfloat16),
                                                             ("nf4", False, 64, torch.float16)])
@pytest.mark.parametrize("n,kk,tail", [(5800, 2048, (22, 4)), (7100, 3072, (22, 2))])
def test_wgmma_tail_split_vs_float64(k, fmt, zero_point, group_size, dtype, n, kk, tail):
    """``"split_k": "auto"`` where `wgmma_tail_split` takes two launches: the first row-tile columns unsplit (one
    whole wave: 22 columns of 6 token tiles), the last column in 4 or 2 parts in a second launch whose reduction
    writes that column slice (its rows partly padding, the last token tile partial), with a bias, on poisoned
    outputs against float64."""
    m = 700
    assert k.tuning.wgmma_tail_split(m, -(-n // 128) * 128, kk, 128, 256, 132) == tail
    qw = k.quantize(_weight(n, kk, dtype, seed=9), group_size=group_size, zero_point=zero_point, fmt=fmt)
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    _check_wgmma(k, x, qw, bias, {"block_m": 128, "block_n": 256, "num_stages": 3, "inflight": 2,
                                  "split_k": "auto"})


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma is Hopper's (sm_90a)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [200, 700])
def test_untuned_shape_runs_the_heuristic_wgmma_tile(k, dtype, m):
    """A shape no table holds (N x K = 4096 x 8448) takes the heuristic's wgmma tile through `matmul` (split per
    call), within tolerance of float64 with integer zero points and a bias."""
    n, kk = 4096, 8448
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    config = k.tuning.select(m, n, kk, x.device)
    assert k.tuning.resolve(config, x, None, 128, has_zeros=True)["kernel"] == "wgmma"
    qw = k.quantize(_weight(n, kk, dtype, seed=5), group_size=128, zero_point=True)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    assert _rel_err(k.matmul(x, qw, bias), _reference(k, x, qw, bias)) < TOL[dtype]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma is Hopper's (sm_90a)")
@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("tiles", [{"block_m": 128, "num_stages": 4},
                                   {"block_m": 128, "block_n": 256, "num_stages": 3, "inflight": 2}],
                         ids=["128x128", "128x256-inflight2"])
@pytest.mark.parametrize("lookup", [{}, {"nf4_smem": False}], ids=["pair-table", "prmt"])
def test_wgmma_nf4_operand_is_the_dequantized_weight(k, group_size, dtype, scale_dtype, tiles, lookup):
    """NF4's register operand equals the dequantize path's weight bit for bit: the codebook rounded to fp16 times
    the scale, rounded once to x's dtype (float32 scales, as bitsandbytes stores its absmax, are moved off the
    fp16 grid so that rounding them first would show), from the shared-memory pair table (the default) or the
    byte permutes. Each row of x is one-hot, so each output is one weight."""
    n, kk, m = 1000, 3072 if group_size != -1 else 3000, 256
    qw = k.quantize(_weight(n, kk, dtype, seed=3), group_size=group_size, fmt="nf4")
    if scale_dtype == torch.float32:
        qw = dataclasses.replace(qw, scales=qw.scales.float() * (1 + 2.0 ** -13))
    cpu = qw.to("cpu")
    weight = k.reference.dequantize(cpu.qweight, cpu.scales, None, None, cpu.codebook.half().float(), None, n, kk,
                                    group_size, dtype)
    columns = torch.randperm(kk, generator=torch.Generator().manual_seed(0))[:m]
    x = torch.zeros(m, kk, dtype=dtype)
    x[torch.arange(m), columns] = 1
    config = {**k.tuning.heuristic(m, n, kk, 132), "wgmma": tiles, **lookup}
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    k.triton_kernels.matmul(x.cuda(), qw.qweight, qw.scales, None, qw.codebook, None, n, kk, group_size, config,
                            out=out)
    assert torch.equal(out.cpu(), weight[:, columns].t())


MMA_FORMATS = [("int4", True, 128), ("int4", False, 128), ("int4", True, -1), ("int4", False, 32), ("int4", True, 32),
               ("int4", True, 64), ("int4", True, 256), ("nf4", False, 64), ("nf4", False, 32), ("nf4", False, -1)]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="mma.sync needs sm_80+")
@pytest.mark.parametrize("fmt,zero_point,group_size", MMA_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tiles", [{"num_warps": 4}, {"num_warps": 4, "reps": 2, "tiles": 3, "split_k": 3},
                                   {"block_m": 16, "num_warps": 2, "tiles": 4, "split_k": 2},
                                   {"num_warps": 4, "tiles": 4, "split_k": 3, "x_smem": True},
                                   {"block_m": 16, "num_warps": 4, "tiles": 2, "x_smem": True},
                                   {"num_warps": 4, "tiles": 2, "stages": 3, "split_k": 3},
                                   {"block_m": 16, "num_warps": 2, "reps": 2, "tiles": 4, "stages": 2},
                                   {"block_m": 16, "num_warps": 4, "reps": 2, "tiles": 2, "stages": 3, "split_k": 2}],
                         ids=["8x64", "8x128-3tiles-split3", "16x32-4tiles-split2", "8x64-4tiles-split3-xsmem",
                              "16x64-2tiles-xsmem", "8x64-2tiles-3stages-split3", "16x64-4tiles-2stages",
                              "16x128-2tiles-3stages-split2"])
@pytest.mark.parametrize("m", [1, 13])
def test_mma_gemv_vs_float64(k, fmt, zero_point, group_size, dtype, tiles, m):
    """The Gluon tensor-core GEMV on poisoned outputs against float64: one token (a tile of one live row), 13
    (two 8-token tiles, or one of 16, partial), split-K partials; N = 3000 leaves a partial row tile, K = 5000
    (per channel) a partial K-tile; a second launch must give the same bits."""
    n, kk = 3000, 5120 if group_size != -1 or "stages" in tiles else 5000
    qw = k.quantize(_weight(n, kk, dtype, seed=10), group_size=group_size, zero_point=zero_point, fmt=fmt)
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    config = {**k.tuning.heuristic(m, n, kk, 132), "mma": tiles}
    plan = k.tuning.resolve(config, x, qw.codebook, group_size, has_zeros=zero_point is True)
    assert plan["kernel"] == "mma" and plan.get("stages", 1) == tiles.get("stages", 1)
    _check_launch(k, x, qw, bias, config)
    first, second = (k.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, qw.codebook, bias, n, kk, group_size,
                                             config) for _ in range(2))
    assert torch.equal(first, second)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="mma.sync needs sm_80+")
@pytest.mark.parametrize("group_size", [64, 128, -1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tiles", [{"num_warps": 4, "reps": 2, "tiles": 3, "split_k": 3},
                                   {"block_m": 16, "num_warps": 2, "reps": 2, "tiles": 4, "stages": 2},
                                   {"block_m": 16, "num_warps": 4, "reps": 2, "tiles": 2, "stages": 3, "split_k": 2}],
                         ids=["8x128-3tiles-split3", "16x64-4tiles-2stages", "16x128-2tiles-3stages-split2"])
@pytest.mark.parametrize("m", [1, 13])
@pytest.mark.parametrize("lookup", [{"nf4_shfl": True}, {"nf4_shfl": "half"}, {"nf4_smem": True}],
                         ids=["shfl", "shfl-half", "smem"])
def test_mma_gemv_nf4_shuffle_lookup_vs_float64(k, group_size, dtype, tiles, m, lookup):
    """NF4 on the mma GEMV with the codebook looked up by warp shuffles (`nf4_shfl`: every nibble, or half of
    them) or in the shared-memory pair table (`nf4_smem`), on poisoned outputs against float64, and bit-equal to
    the PRMT lookup (all give the codebook / 16 in x's dtype exactly)."""
    n, kk = 3000, 5120
    qw = k.quantize(_weight(n, kk, dtype, seed=12), group_size=group_size, fmt="nf4")
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    config = {**k.tuning.heuristic(m, n, kk, 132), "mma": tiles, "nf4_smem": False}
    shuffle = {**config, **lookup}
    plan = k.tuning.resolve(shuffle, x, qw.codebook, group_size)
    assert plan["kernel"] == "mma" and plan.items() >= lookup.items()
    _check_launch(k, x, qw, None, shuffle)
    by_shuffles, by_permutes = (k.triton_kernels.matmul(x, qw.qweight, qw.scales, None, qw.codebook, None, n, kk,
                                                        group_size, c) for c in (shuffle, config))
    assert torch.equal(by_shuffles, by_permutes)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="mma.sync needs sm_80+")
@pytest.mark.parametrize("fmt,zero_point,group_size", [("int4", True, 128), ("int4", False, 32), ("nf4", False, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tiles", [{"block_m": 32, "num_warps": 4, "tiles": 2, "stages": 3, "split_k": 2},
                                   {"block_m": 64, "num_warps": 4, "tiles": 1, "stages": 4}], ids=["32x64", "64x64"])
def test_mma_gemv_wide_token_tiles_vs_float64(k, fmt, zero_point, group_size, dtype, tiles):
    """Token tiles of 32 and 64 on poisoned outputs against float64: 70 tokens make full tiles and a partial
    last one."""
    n, kk, m = 3000, 5120, 70
    qw = k.quantize(_weight(n, kk, dtype, seed=11), group_size=group_size, zero_point=zero_point, fmt=fmt)
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    config = {**k.tuning.heuristic(m, n, kk, 132), "mma": tiles}
    assert k.tuning.resolve(config, x, qw.codebook, group_size, has_zeros=zero_point is True)["kernel"] == "mma"
    _check_launch(k, x, qw, torch.randn(n, device="cuda", dtype=dtype), config)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="mma.sync needs sm_80+")
def test_mma_gemv_ring_takes_x_rows_cp_async_cannot_copy_in_one_stage(k):
    """x rows the cp.async ring cannot copy in 16-byte pieces (a column slice; K = 1000, which ends inside a
    128-column tile and is no multiple of 16) take one stage, and the results stay exact."""
    for kk, cut in ((1024, 3), (1000, 0)):
        qw = k.quantize(_weight(512, kk, torch.float16), group_size=-1 if kk % 128 else 128)
        x = torch.randn(4, kk + cut, device="cuda", dtype=torch.float16)[:, cut:]
        config = {**k.tuning.heuristic(4, 512, kk, 132), "mma": {"num_warps": 4, "tiles": 2, "stages": 3}}
        assert k.tuning.resolve(config, x, None, qw.group_size, has_zeros=True)["stages"] == 1
        _check_launch(k, x, qw, None, config)
    assert k.tuning.resolve(config, torch.randn(4, 1024, device="cuda", dtype=torch.float16), None, 128,
                            has_zeros=True)["stages"] == 3


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="mma.sync needs sm_80+")
def test_mma_gemv_leaves_formats_it_does_not_take_to_the_config_beneath(k):
    """Float minima are not the mma kernel's: the config it sits in runs them (and stays exact)."""
    x = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    config = {**k.tuning.heuristic(1, 512, 1024, 132), "mma": {"num_warps": 4}}
    qw = k.quantize(_weight(512, 1024, torch.float16), group_size=64, zero_point="float")
    plan = k.tuning.resolve(config, x, qw.codebook, 64, has_mins=qw.mins is not None)
    assert plan["kernel"] != "mma"
    _check_launch(k, x, qw, None, config)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma is Hopper's (sm_90a)")
def test_wgmma_refuses_tiles_it_does_not_have(k):
    """The row tile is one or two warpgroups of `chains` 64-row chains (1 or 2) and must divide the padded rows;
    other tiles are a ValueError naming block_n, and more tokens than a warpgroup's accumulators hold (128 with two
    chains, 256 with one) one naming block_m; so is an `inflight` other than 1, 2 or 3, a `chains` other than 1 or
    2, and a `split_k` that is neither a positive count nor "auto"."""
    qw = k.quantize(_weight(384, 1024, torch.float16), group_size=128)
    x = torch.randn(128, 1024, device="cuda", dtype=torch.float16)
    for tiles, name in (({"block_m": 128, "block_n": 256}, "block_n"), ({"block_m": 64, "block_n": 64}, "block_n"),
                        ({"block_m": 64, "block_n": 32, "chains": 1}, "block_n"), ({"block_m": 256}, "block_m"),
                        ({"block_m": 64, "chains": 3}, "chains"),
                        ({"block_m": 64, "inflight": 4}, "inflight"), ({"block_m": 64, "split_k": 0}, "split_k"),
                        ({"block_m": 64, "split_k": "fastest"}, "split_k")):
        config = {**k.tuning.heuristic(128, 384, 1024, 132), "wgmma": tiles}
        with pytest.raises(ValueError, match=name):
            k.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, None, None, 384, 1024, 128, config)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("swap_ab,descs", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("nf4_tables,half_scale", [(True, True), (True, False), (False, False)],
                         ids=["tables-fp16-scales", "tables-fp32-scales", "gathers"])
def test_nf4_dot_vs_float64(k, group_size, dtype, swap_ab, descs, nf4_tables, half_scale):
    """NF4 on the full-tile dot path, the codebook looked up by byte permutes (groups of 64 scaled by packed fp16
    multiplies or in fp32) or gathered, on poisoned outputs against float64; M = 37 leaves a partial token
    tile, K per channel is not a multiple of 128."""
    n, kk, m = 3000, 5120 if group_size != -1 else 5000, 37
    qw = k.quantize(_weight(n, kk, dtype, seed=8), group_size=group_size, fmt="nf4")
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    config = {"kernel": "dot", "block_m": 64, "block_n": 64, "split_k": 2, "swap_ab": swap_ab, "num_warps": 4,
              "num_stages": 3, "full_tile": True, "x_desc": descs, "w_desc": descs, "nf4_tables": nf4_tables,
              "nf4_half_scale": half_scale}
    plan = k.tuning.resolve(config, x, qw.codebook, group_size)
    assert plan["nf4_tables"] == nf4_tables and plan["nf4_half_scale"] == (half_scale and dtype == torch.float16)
    _check_launch(k, x, qw, bias, config)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tile, group_size", [
    ({"block_m": 64, "block_n": 64, "split_k": 2, "num_warps": 4}, 64),
    ({"block_m": 64, "block_n": 64, "split_k": 2, "num_warps": 4}, 128),
    # NF4 takes this tile with groups of 64 only: with a scale per whole tile it overflows shared memory even
    # without the table (245808 bytes on the H100, run 181; `tuning._nf4_int4_tiles`)
    ({"block_m": 256, "block_n": 128, "split_k": 1, "num_warps": 8}, 64)], ids=["64x64-g64", "64x64-g128", "256x128-g64"])
@pytest.mark.parametrize("copies", [32, 16])
def test_nf4_dot_pair_table_keeps_the_bits(k, group_size, dtype, tile, copies):
    """NF4 on the full-tile dot path from the shared-memory pair table ("nf4_smem") gives the PRMT lookup's bits:
    the same codebook values, scaled and summed alike, from the whole table or the half one (16 copies, E75); on
    the 256 x 128 tile the whole table does not fit beside the ring and the PRMT lookup runs there, the half one
    does. M = 37 leaves a partial token tile."""
    n, kk, m = 3000, 5120, 37
    qw = k.quantize(_weight(n, kk, dtype, seed=10), group_size=group_size, fmt="nf4")
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    config = {"kernel": "dot", "swap_ab": True, "num_stages": 3, "full_tile": True, "x_desc": True, "w_desc": True,
              "nf4_smem": True, "nf4_table_copies": copies, **tile}
    _check_launch(k, x, qw, None, config)
    by_table, by_permutes = (k.triton_kernels.matmul(x, qw.qweight, qw.scales, None, qw.codebook, None, n, kk,
                                                     group_size, c) for c in (config, {**config, "nf4_smem": False}))
    assert torch.equal(by_table, by_permutes)


@pytest.mark.parametrize("group_size", [64, 128, -1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pipeline", [{}, {"block_n": 16, "num_stages": 3, "x_bcast": True, "tma": True},
                                      {"block_n": 16, "num_stages": 3, "x_bcast": True, "tma": True, "num_warps": 2}],
                         ids=["plain", "bcast-tma", "bcast-tma-2warps"])
@pytest.mark.parametrize("lookup", [{"nf4_smem": False}, {"nf4_shfl": True}, {"nf4_shfl": "half"}, {}],
                         ids=["prmt", "shfl", "shfl-half", "smem"])
def test_half2_gemv_nf4_vs_float64(k, group_size, dtype, pipeline, lookup):
    """NF4 through the packed-fp16 GEMV (codebook looked up with PRMT byte permutes, warp shuffles or the
    shared-memory pair table, inline PTX), with groups of 64 (each half of a 128-column tile scaled apart), on
    poisoned outputs against float64."""
    n, kk = 3000, 5120
    qw = k.quantize(_weight(n, kk, dtype, seed=8), group_size=group_size, fmt="nf4")
    x = torch.randn(2, kk, device="cuda", dtype=dtype)
    assert k.tuning.half2_supported(x, qw.codebook, group_size)
    config = {"kernel": "gemv", "block_n": 8, "tiles": 8, "split_k": 3, "num_warps": 4, "half2": True, **pipeline,
              **lookup}
    _check_launch(k, x, qw, None, config)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pipeline", [{"block_n": 8, "tiles": 8, "split_k": 3, "num_warps": 4},
                                      {"block_n": 16, "tiles": 8, "num_warps": 2, "num_stages": 3, "x_bcast": True,
                                       "tma": True}], ids=["plain-split", "bcast-tma-2warps"])
def test_half2_gemv_nf4_pair_table_keeps_the_bits(k, dtype, pipeline):
    """The shared-memory pair table (`nf4_smem`, the default), alone or in persistent programs, gives the PRMT
    lookup's output bit for bit: all take the codebook / 16 rounded to fp16 and sum the same products in the same order. The TMA
    plan's 24 KB ring with the 32 KB table is over the driver's default 48 KB (the launcher's load hook)."""
    n, kk = 3000, 5120
    qw = k.quantize(_weight(n, kk, dtype, seed=9), group_size=64, fmt="nf4")
    x = torch.randn(1, kk, device="cuda", dtype=dtype)
    config = {"kernel": "gemv", "half2": True, **pipeline}
    outs = []
    for lookup in ({"nf4_smem": False}, {}, {"persistent": 1}):
        out = torch.full((1, n), float("nan"), device="cuda", dtype=dtype)
        k.triton_kernels.matmul(x, qw.qweight, qw.scales, None, qw.codebook, None, n, kk, 64, {**config, **lookup},
                                out=out)
        outs.append(out)
    for out in outs[1:]:
        assert not out.isnan().any()
        assert torch.equal(out, outs[0])


SWIGLU_CONFIGS = {  # every path with the SwiGLU epilogue; resolve makes the GEMVs' 8-row tiles 16-row ones
    "gemv-half2": {"kernel": "gemv", "block_n": 8, "tiles": 8, "split_k": 1, "num_warps": 4, "half2": True},
    "gemv-half2-split": {"kernel": "gemv", "block_n": 8, "tiles": 8, "split_k": 3, "num_warps": 4, "prefetch": True,
                         "half2": True},
    "gemv-half2-bcast-tma": {"kernel": "gemv", "block_n": 16, "tiles": 8, "split_k": 1, "num_warps": 2,
                             "num_stages": 3, "x_bcast": True, "tma": True, "half2": True},
    "gemv": {"kernel": "gemv", "block_n": 8, "tiles": 8, "split_k": 1, "num_warps": 4},
    "gemv-split": {"kernel": "gemv", "block_n": 32, "tiles": 4, "split_k": 3, "num_warps": 8, "num_stages": 2},
    "dot-swap-packed-split": {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 3, "swap_ab": True,
                              "num_warps": 4, "num_stages": 3, "packed": True},
    "dot-swap-packed-tma": {"kernel": "dot", "block_m": 64, "block_n": 128, "split_k": 1, "swap_ab": True,
                            "num_warps": 8, "num_stages": 3, "packed": True, "x_desc": True,
                            "w_desc": True},
    "dot-unswapped": {"kernel": "dot", "block_m": 64, "block_n": 128, "split_k": 1, "swap_ab": False, "num_warps": 8,
                      "num_stages": 3, "packed": True},
    "dot-unswapped-full-tile": {"kernel": "dot", "block_m": 64, "block_n": 64, "split_k": 2, "swap_ab": False,
                                "num_warps": 4, "num_stages": 3, "full_tile": True},
    "dequant-chunks": {"kernel": "dequant", "chunk_n": 1024},
}
SWIGLU_FORMATS = [("int4", False, 128), ("int4", True, 128), ("int4", True, 64), ("int4", True, -1), ("nf4", False, 64),
                  ("int4", "float", 32)]


def _swiglu_reference(k, x, gate, up, biases):
    """float64 silu(x @ Wg.T + bg) * (x @ Wu.T + bu) from the separately dequantized weights."""
    g, u = (_reference(k, x, w, b) for w, b in zip((gate, up), biases))
    return torch.nn.functional.silu(g) * u


def _gate_up(k, inter, kk, dtype, fmt, zero_point, group_size, seed):
    gate, up = (k.quantize(_weight(inter, kk, dtype, seed=seed + i), group_size=group_size, zero_point=zero_point,
                           fmt=fmt) for i in range(2))
    biases = [torch.randn(inter, device="cuda", dtype=dtype) for _ in range(2)]
    fused, bias = k.fusion.interleave_gate_up(k.fusion.concat_weights([gate, up]), torch.cat(biases))
    return gate, up, biases, fused, bias


@pytest.mark.parametrize("path", list(SWIGLU_CONFIGS))
@pytest.mark.parametrize("fmt,zero_point,group_size", SWIGLU_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_swiglu_epilogue_vs_float64(k, path, fmt, zero_point, group_size, dtype):
    """silu(gate) * up [M, I] from each path's epilogue (split-K: the reduction kernel's; dequantize + cuBLAS: one
    more kernel) on poisoned outputs against float64. I = 1504 leaves a partial 128-row tile; K per channel is not
    a multiple of 128; M = 37 (M = 2 on the GEMVs) leaves a partial token tile. The epilogue works on the fp32
    accumulators and rounds once, so the matmul's TOL holds (see tests/test_w4a16.py, _check_swiglu_launch)."""
    config = SWIGLU_CONFIGS[path]
    inter, kk = 1504, 5120 if group_size != -1 else 5000
    m = 2 if config["kernel"] == "gemv" else 37
    gate, up, biases, fused, bias = _gate_up(k, inter, kk, dtype, fmt, zero_point, group_size, seed=10)
    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    out = torch.full((m, inter), float("nan"), device="cuda", dtype=dtype)
    k.triton_kernels.matmul(x, fused.qweight, fused.scales, fused.zeros, fused.codebook, bias, 2 * inter, kk,
                            group_size, config, out=out, swiglu=True, mins=fused.mins)
    assert not out.isnan().any()
    assert _rel_err(out, _swiglu_reference(k, x, gate, up, biases)) < TOL[dtype]


@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 1024])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_swiglu_matmul_tuned_configs(k, m, dtype):
    """Through the op on Llama-3-8B's gate / up (K 4096, 2 x 14336 rows: a tuned shape), the table's configs with the
    epilogue: the packed-fp16 GEMV's 8-row tiles as 16-row ones, the tuned dot tiles, dequantize + cuBLAS."""
    gate, up, biases, fused, bias = _gate_up(k, 14336, 4096, dtype, "int4", False, 128, seed=11)
    x = torch.randn(m, 4096, device="cuda", dtype=dtype)
    out = k.swiglu_matmul(x, fused, bias)
    assert out.shape == (m, 14336) and out.dtype == dtype
    assert _rel_err(out, _swiglu_reference(k, x, gate, up, biases)) < TOL[dtype]


def test_swiglu_matmul_compiles_and_replays(k):
    """torch.compile(fullgraph=True) and CUDA-graph replay of the SwiGLU op at M = 1, 16 and 1024, bit for bit
    with eager."""
    _, _, _, fused, bias = _gate_up(k, 2048, 2048, torch.float16, "int4", False, 128, seed=12)
    fn = torch.compile(lambda x: k.swiglu_matmul(x, fused, bias) * 2, fullgraph=True)
    inputs = {m: torch.randn(m, 2048, device="cuda", dtype=torch.float16) for m in (1, 16, 1024)}
    for x in inputs.values():
        torch.testing.assert_close(fn(x), k.swiglu_matmul(x, fused, bias) * 2, rtol=0, atol=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in inputs.values():
            k.swiglu_matmul(x, fused, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {m: k.swiglu_matmul(x, fused, bias) for m, x in inputs.items()}
    for x in inputs.values():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for m, x in inputs.items():
        torch.testing.assert_close(outs[m], k.swiglu_matmul(x, fused, bias), rtol=0, atol=0)


def test_act_order_gptq_full_size(k):
    """A GPTQ act-order weight: the matmul permutes x and matches the dequantized weight."""
    n, kk, g = 4096, 4096, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    codes = torch.randint(0, 16, (kk, n), device="cuda", dtype=torch.int32, generator=gen)
    shifts = torch.arange(0, 32, 4, device="cuda", dtype=torch.int32)
    qweight = (codes.view(kk // 8, 8, n) << shifts.view(1, 8, 1)).sum(1, dtype=torch.int32)
    scales = torch.rand(kk // g, n, device="cuda", dtype=torch.float16) * 0.01 + 1e-3
    qzeros = torch.full((kk // g, n // 8), 0x77777777, device="cuda", dtype=torch.int32)  # v1 symmetric
    g_idx = (torch.randperm(kk, device="cuda", generator=gen) // g).int()
    qw = k.from_gptq(qweight, qzeros, scales, g_idx)
    weight = (codes.double() - 8) * scales.double()[g_idx.long()]  # [K, N], what the checkpoint means
    x = torch.randn(16, kk, device="cuda", dtype=torch.float16)
    for m in (1, 16):
        assert _rel_err(k.matmul(x[:m], qw), x[:m].double() @ weight) < TOL[torch.float16]


DEPENDENT_LAUNCHES = [  # (m, config): each decode kernel, split-K (its reduction launched as a dependent too)
    (1, {"kernel": "gemv", "tiles": 8, "num_warps": 4, "half2": {"block_n": 8, "tiles": 8, "num_warps": 4}}),
    (1, {"kernel": "gemv", "half2": {"block_n": 16, "tiles": 8, "num_warps": 2, "num_stages": 3, "x_bcast": True,
                                     "tma": True, "split_k": 3}}),
    # E66: the next kernel let launch right after the wait
    (1, {"kernel": "gemv", "half2": {"block_n": 16, "tiles": 8, "num_warps": 2, "num_stages": 3, "x_bcast": True,
                                     "tma": True, "pdl_trigger": "start"}}),
    (1, {"kernel": "gemv", "half2": {"block_n": 8, "tiles": 8, "num_warps": 4, "split_k": 2, "pdl_trigger": "start"}}),
    # E73: persistent programs, the trigger after a program's last item or at its start
    (1, {"kernel": "gemv", "half2": {"block_n": 8, "tiles": 8, "num_warps": 4, "split_k": 2, "persistent": 2}}),
    (1, {"kernel": "gemv", "half2": {"block_n": 16, "tiles": 8, "num_warps": 2, "num_stages": 3, "x_bcast": True,
                                     "tma": True, "persistent": 1, "pdl_trigger": "start"}}),
    (4, {**CONFIGS[3], "mma": {"num_warps": 2, "tiles": 2, "stages": 4, "split_k": 2}}),
    (13, {**CONFIGS[3], "mma": {"block_m": 16, "num_warps": 4, "reps": 2, "tiles": 2, "stages": 3}}),
    (64, {"kernel": "dot", "block_m": 64, "block_n": 64, "split_k": 2, "swap_ab": True, "full_tile": True,
          "packed": True, "num_warps": 4, "num_stages": 3, "x_desc": True, "w_desc": True}),
    (200, {"kernel": "dot", "block_m": 128, "block_n": 64, "split_k": 1, "swap_ab": True, "full_tile": True,
           "packed": True, "num_warps": 4, "num_stages": 3}),
]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs sm_90+")
@pytest.mark.parametrize("m,config", DEPENDENT_LAUNCHES,
                         ids=["h2", "h2-tma-split3", "h2-tma-start", "h2-split2-start", "h2-split2-persistent",
                              "h2-tma-persistent-start", "mma-split2",
                              "mma-16x128", "dot-tma-split2", "dot-128x64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dependent_launch_chains(k, m, config, dtype):
    """The decode and tensor-core kernels as programmatic dependents (`launch.dependent_launch`): a chain of 8
    matmuls launched back to back (each lets the next start early), each reading what the one before wrote and
    writing memory the allocator hands back from freed outputs, gives the bits of serial launches, eagerly and in
    CUDA-graph replay with fresh inputs. A kernel that read x or wrote before its wait would read the previous
    layer's output half written. bf16 x adds the packed-fp16 GEMV's pre-pass to the chain; the dot path's split-K
    reduction lets the next kernel launch only after its stores."""
    n, kk = 3072, 4096
    # weights of std 0.015: a layer keeps x's scale within ~20 %, so 8 of them stay in fp16's range
    up = k.quantize(_weight(n, kk, dtype, seed=20) * 0.3, group_size=128, zero_point=True)
    down = k.quantize(_weight(kk, n, dtype, seed=21) * 0.3, group_size=128, zero_point=True)
    dependent, serial = {**config, "pdl": True}, {**config, "pdl": False}
    assert k.triton_kernels.launch.dependent_launch(
        k.tuning.resolve(dependent, torch.empty(m, kk, device="cuda", dtype=dtype), None, 128), up.qweight.device)

    def chain(x, cfg):
        for layer in range(8):
            qw = up if layer % 2 == 0 else down
            n_out, k_in = qw.shape
            x = k.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, None, None, n_out, k_in, 128, cfg)
        return x

    x = torch.randn(m, kk, device="cuda", dtype=dtype)
    want = chain(x, serial)
    assert want.isfinite().all() and want.abs().max() > 0
    for _ in range(5):
        assert torch.equal(chain(x, dependent), want)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(static_x, dependent)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_x, dependent)
    for seed in range(5):
        fresh = torch.randn(m, kk, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(fresh)
        graph.replay()
        assert torch.equal(static_out, chain(fresh, serial))


@pytest.mark.parametrize("m", [1, 64])
def test_torch_compile_fullgraph(k, m):
    qw = k.quantize(_weight(4096, 4096, torch.float16), group_size=128)
    bias = torch.randn(4096, device="cuda", dtype=torch.float16)
    fn = torch.compile(lambda x: k.matmul(x, qw, bias) * 2, fullgraph=True)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(fn(x), k.matmul(x, qw, bias) * 2, rtol=0, atol=0)


def test_cuda_graph_replay(k):
    qw = k.quantize(_weight(4096, 4096, torch.bfloat16), group_size=128)
    inputs = {m: torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for m in (1, 16, 1024)}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in inputs.values():
            k.matmul(x, qw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {m: k.matmul(x, qw) for m, x in inputs.items()}
    for x in inputs.values():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for m, x in inputs.items():
        torch.testing.assert_close(outs[m], k.matmul(x, qw), rtol=0, atol=0)


def test_quantized_model_compiles(k):
    model = torch.nn.Sequential(torch.nn.Linear(2048, 5632), torch.nn.SiLU(), torch.nn.Linear(5632, 2048))
    model = model.to("cuda", torch.bfloat16)
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    want = model(x)
    k.quantize_model(model, group_size=128)
    assert isinstance(model[0], k.W4A16Linear)
    eager = model(x)
    got = torch.compile(model, fullgraph=True)(x)
    assert _rel_err(got, eager.double()) < TOL[torch.bfloat16]
    assert _rel_err(got, want.double()) < 0.2  # 4-bit weights: the quantization error itself (~7% here)


@pytest.mark.parametrize("slot_bytes", [None, 4096])
def test_checkpoint_loads_onto_the_gpu_as_on_the_cpu(k, tmp_path, monkeypatch, slot_bytes):
    """`load_checkpoint` onto the GPU (pinned slots the host refills while the copies run) gives the CPU load's
    tensors bit for bit: GPTQ layers of different sizes, and with 4 KB slots every tensor in many pieces, so a
    slot refilled before its copy finished would show."""
    if slot_bytes is not None:
        monkeypatch.setattr(k.checkpoints._HostToDevice, "SLOT_BYTES", slot_bytes)
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    sizes = [(256, 512), (1024, 256), (512, 1024), (256, 512)]  # (out, in)
    tensors = {}
    for i, (n, kk) in enumerate(sizes):
        tensors[f"layers.{i}.qweight"] = torch.randint(-2**31, 2**31, (kk // 8, n), generator=gen, dtype=torch.int32)
        tensors[f"layers.{i}.qzeros"] = torch.randint(-2**31, 2**31, (kk // 128, n // 8), generator=gen,
                                                      dtype=torch.int32)
        tensors[f"layers.{i}.scales"] = (torch.rand(kk // 128, n, generator=gen) * 1e-2 + 1e-3).half()
        tensors[f"layers.{i}.bias"] = torch.randn(n, generator=gen).half()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "quantize_config.json").write_text('{"bits": 4, "group_size": 128, "desc_act": false, "sym": false, '
                                                   '"checkpoint_format": "gptq"}')

    def model():
        with torch.device("meta"):
            m = torch.nn.Module()
            m.layers = torch.nn.ModuleList(torch.nn.Linear(kk, n) for n, kk in sizes)
        return m

    on_cpu = k.load_checkpoint(model(), tmp_path, device="cpu", dtype=torch.float16)
    on_gpu = k.load_checkpoint(model(), tmp_path, device="cuda", dtype=torch.float16)
    cpu_state, gpu_state = on_cpu.state_dict(), on_gpu.state_dict()
    assert cpu_state.keys() == gpu_state.keys() and len(cpu_state) >= 4 * len(sizes)
    for name, tensor in cpu_state.items():
        assert gpu_state[name].is_cuda and torch.equal(gpu_state[name].cpu(), tensor), name
