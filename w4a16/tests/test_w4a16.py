"""w4a16 on the CPU: the Triton kernels through the interpreter and the PyTorch path, small shapes.

References are float64 matmuls with the dequantized weight, on fresh random data. Checkpoint tensors are
built the way GPTQ (AutoGPTQ / GPTQModel), AutoAWQ and bitsandbytes lay them out (packing axis, nibble
order, zero-point convention), independently of the importers under test.
"""

import math

import pytest
import torch

# (fmt, zero_point, group_size, K): K is a multiple of the group size and, apart from the per-tile
# cases, not of the 128-column tile (the masked tails run too); N = 72 pads to 128 rows.
FORMATS = [
    ("int4", False, 128, 384),
    ("int4", True, 128, 384),
    ("int4", False, 32, 320),
    ("int4", True, 64, 320),
    ("int4", False, -1, 200),
    ("int4", True, -1, 200),
    ("nf4", False, 64, 320),
    ("int4", "float", 32, 320),  # float minima: GGUF Q4_1 / Q4_K's layout
    ("int4", "float", 128, 384),
]
FORMAT_IDS = [f"{f}-{'zp' if z is True else 'min' if z == 'float' else 'sym'}-g{g}" for f, z, g, _ in FORMATS]
N = 72
CONFIGS = {  # one per launch path, with split-K, prefetch, the full-tile dot and row chunks covered
    "gemv": {"kernel": "gemv", "block_n": 64, "tiles": 2, "split_k": 1},
    "gemv-split-prefetch": {"kernel": "gemv", "block_n": 128, "tiles": 1, "split_k": 2, "prefetch": True},
    "dot-planes": {"kernel": "dot", "block_m": 16, "block_n": 128, "split_k": 1},
    "dot-full-swap-split": {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 2, "swap_ab": True,
                            "full_tile": True},
    # Operands (code - zero) / 16 from integer ops, swapped or not; formats they
    # do not take (groups of 32 / 64, NF4) run the dequantized planes.
    "dot-packed-swap-split": {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 2, "swap_ab": True,
                              "packed": True},
    "dot-packed": {"kernel": "dot", "block_m": 16, "block_n": 128, "split_k": 1, "packed": True},
    # x and the weight words by TMA descriptors (zero-filled past M and K).
    "dot-packed-tma": {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 2, "swap_ab": True, "packed": True,
                       "x_desc": True, "w_desc": True},
    "dequant-chunks": {"kernel": "dequant", "chunk_n": 128},
    # The packed-fp16 GEMV, emulated in the interpreter (no inline PTX there): its tiles, masks, split-K, zero
    # points, int4 groups of 32 / 64 (symmetric or minima); the formats it does not take (int4 groups of 64 with
    # zero points) run the portable GEMV.
    "gemv-half2": {"kernel": "gemv", "block_n": 64, "tiles": 2, "split_k": 1, "half2": True},
    "gemv-half2-split-prefetch": {"kernel": "gemv", "block_n": 32, "tiles": 2, "split_k": 2, "prefetch": True,
                                  "half2": True},  # K = 384: 3 tiles in 2 splits of 2, the last tile masked
    # Weight tiles software-pipelined through shared memory, x broadcast over the rows: a cp.async ring, and
    # TMA boxes (zero-filled past the last tile).
    "gemv-half2-staged": {"kernel": "gemv", "block_n": 32, "tiles": 2, "split_k": 2, "num_stages": 3, "x_bcast": True,
                          "half2": True},
    "gemv-half2-tma": {"kernel": "gemv", "block_n": 32, "tiles": 2, "split_k": 2, "num_stages": 3, "x_bcast": True,
                       "tma": True, "half2": True},
    # 4 programs (the interpreter's SM count) taking rows x splits x tokens items in turn
    "gemv-half2-persistent": {"kernel": "gemv", "block_n": 32, "tiles": 2, "split_k": 2, "num_stages": 3,
                              "x_bcast": True, "tma": True, "half2": {"persistent": 1}},
    # As the tuned tables write it: the fp32 GEMV's tiles, and the packed-fp16 GEMV's own where it applies.
    "gemv-half2-own-tiles": {"kernel": "gemv", "block_n": 64, "tiles": 2, "split_k": 1,
                             "half2": {"block_n": 32, "tiles": 1, "split_k": 2, "prefetch": True}},
}
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # one rounding of the result (and of weights on dot paths)


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("w4a16")


@pytest.fixture
def torch_path(monkeypatch):
    """Force the PyTorch path: the dispatch reads TRITON_INTERPRET at call time."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weight(n, kk, dtype=torch.float16, seed=0):
    return (torch.randn(n, kk, generator=_gen(seed)) * 0.1).to(dtype)


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _reference(k, x, qw, bias=None):
    out = x.double() @ k.dequantize(qw, torch.float32).double().t()
    return out if bias is None else out + bias.double()


def _pack_along(codes: torch.Tensor, dim: int, order=range(8)) -> torch.Tensor:
    """Pack 4-bit codes 8 to an int32 along `dim`; nibble i holds element 8c + order[i] (int64 math, then
    two's complement), as the checkpoint tools do."""
    codes = codes.movedim(dim, -1).long()
    groups = codes.reshape(*codes.shape[:-1], -1, 8)
    word = torch.zeros(groups.shape[:-1], dtype=torch.int64)
    for i, j in enumerate(order):
        word |= groups[..., j] << (4 * i)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.movedim(-1, dim)


# --- the layout ------------------------------------------------------------------------------------------

def test_layout_tiles_nibbles_as_documented(k):
    codes = torch.randint(0, 16, (130, 200), generator=_gen(1), dtype=torch.uint8)
    packed = k.formats.pack(codes)
    assert packed.shape == (256, 256 // 8) and packed.dtype == torch.int32
    for n, col in [(0, 0), (5, 17), (129, 199), (77, 128), (3, 143)]:
        tile, j, c = col // 128, (col % 128) // 16, col % 16
        assert (int(packed[n, tile * 16 + c]) >> (4 * j)) & 0xF == codes[n, col]
    assert torch.equal(k.formats.unpack(packed, (130, 200)), codes)


@pytest.mark.parametrize("n,kk", [(130, 200), (128, 256), (1, 8), (300, 1000)])
def test_pack_k_words_matches_pack(k, n, kk):
    """GPTQ-style words (8 consecutive K-codes each, [K / 8, N]) re-laid as bytes equal `pack` of their codes,
    padding included (N and K not multiples of 128)."""
    codes = torch.randint(0, 16, (n, kk), generator=_gen(4), dtype=torch.uint8)
    words = torch.zeros(kk // 8, n, dtype=torch.int64)
    for p in range(8):
        words |= codes[:, p::8].t().long() << (4 * p)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(k.formats.pack_k_words(words, (n, kk)), k.formats.pack(codes))


# --- quantize / dequantize -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt,zero_point,group_size,kk", FORMATS, ids=FORMAT_IDS)
def test_quantize_error_bound(k, torch_path, fmt, zero_point, group_size, kk, dtype):
    w = _weight(N, kk, dtype, seed=2)
    if zero_point:
        w = w + 0.05  # off-centre groups, where zero points matter
    qw = k.quantize(w, group_size=group_size, zero_point=zero_point, fmt=fmt)
    assert qw.shape == (N, kk) and qw.dtype == dtype and qw.scales.dtype == dtype
    deq = k.dequantize(qw, torch.float32).double()
    g = kk if group_size == -1 else group_size
    scale = qw.scales[: kk // g, :N].double().t().repeat_interleave(g, dim=1)  # [N, K]
    err = (deq - w.double()).abs()
    if fmt == "int4":  # round to nearest: half a step, plus up to 16 steps times the scale's rounding (bf16: 2**-8)
        assert (err <= scale * (0.5 + 16 * 2**-8) + 1e-7).all()
    else:  # nearest NF4 code of w / absmax: no other code is closer
        codebook = torch.tensor(k.NF4_CODEBOOK, dtype=torch.float64)
        normalized = w.double() / scale
        best = (normalized.unsqueeze(-1) - codebook).abs().min(-1).values
        assert (err / scale <= best + 1e-3).all()
    assert _rel_err(deq, w.double()) < 0.2  # 4 bits: ~7-12 % for normal weights


def test_symmetric_codes_use_zero_point_eight(k):
    w = _weight(N, 256, torch.float32, seed=3)
    qw = k.quantize(w, group_size=128)
    codes = k.formats.unpack(qw.qweight, qw.shape).long()
    ref = torch.round(w.view(N, 2, 128) / qw.scales[:2, :N].t().unsqueeze(-1)).clamp(-8, 7) + 8
    assert torch.equal(codes, ref.view(N, 256).long())


@pytest.mark.parametrize("fmt,zero_point,group_size,kk", FORMATS, ids=FORMAT_IDS)
def test_triton_dequantize_equals_pytorch(k, monkeypatch, fmt, zero_point, group_size, kk):
    qw = k.quantize(_weight(N, kk, seed=4), group_size=group_size, zero_point=zero_point, fmt=fmt)
    triton_out = k.dequantize(qw, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert torch.equal(triton_out, k.dequantize(qw, torch.float32))


@pytest.mark.parametrize("fmt,zero_point,group_size", [("int4", True, 64), ("int4", False, -1), ("nf4", False, 64)])
@pytest.mark.parametrize("tiles,stages", [(2, 3), (4, 2)])
def test_triton_dequantize_pipelined_loop_equals_unrolled(k, fmt, zero_point, group_size, tiles, stages):
    """The dequantize kernel's pipelined loop (stages > 1: a program's tiles past the weight's last are clamped for
    their loads and never stored) writes what the unrolled one does, on a poisoned output; K = 320 ends inside the
    third 128-column tile, and with 2 tiles a program the second program's last tile is past it."""
    qw = k.quantize(_weight(N, 320, seed=5), group_size=group_size, zero_point=zero_point, fmt=fmt)
    rows = qw.qweight.shape[0]
    args = (qw.qweight, qw.scales, qw.zeros, qw.codebook, rows, 320, group_size, torch.float32)
    want = k.triton_kernels.dequantize(*args)
    out = torch.full((rows, 320), float("nan"))
    k.triton_kernels.dequantize(*args, out=out, tiles=tiles, stages=stages)
    assert torch.equal(out, want)
    assert not out.isnan().any()


@pytest.mark.parametrize("group_size,kk", [(64, 320), (128, 384), (256, 512), (-1, 200)])
@pytest.mark.parametrize("scale_dtype,dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                               (torch.bfloat16, torch.float32)])
def test_triton_dequantize_nf4_tables_use_the_fp16_codebook(k, group_size, kk, scale_dtype, dtype):
    """The matmul's NF4 dequantize (byte-permute lookup, emulated in the interpreter) equals dequantizing with the
    codebook rounded to fp16 (the tensor-core path's values) bit for bit, one rounding per weight; poisoned
    output, masked K tail. (No bf16 output here: the interpreter truncates float32 to bf16.)"""
    qw = k.quantize(_weight(N, kk, scale_dtype, seed=4), group_size=group_size, fmt="nf4")
    rows = qw.qweight.shape[0]
    out = torch.full((rows, kk), float("nan"), dtype=dtype)
    k.triton_kernels.dequantize(qw.qweight, qw.scales, None, qw.codebook, rows, kk, group_size, dtype, out=out,
                                nf4_tables=True)
    want = k.reference.dequantize(qw.qweight, qw.scales, None, None, qw.codebook.half().float(), None, rows, kk,
                                  group_size, dtype)
    assert torch.equal(out, want)
    exact = k.reference.dequantize(qw.qweight, qw.scales, None, None, qw.codebook, None, rows, kk, group_size, dtype)
    assert not torch.equal(out, exact)  # the rounded codebook is not the float32 one: the test can tell them apart


# --- matmul: every launch path in the interpreter, and the PyTorch path ----------------------------------

@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("fmt,zero_point,group_size,kk", FORMATS, ids=FORMAT_IDS)
def test_triton_paths_fp16(k, fmt, zero_point, group_size, kk, path):
    _check_launch(k, fmt, zero_point, group_size, kk, CONFIGS[path], torch.float16, m=3 if path != "dot-planes" else 17)


@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("fmt,zero_point,group_size,kk", [FORMATS[i] for i in (1, 6, 7)],
                         ids=[FORMAT_IDS[i] for i in (1, 6, 7)])
def test_triton_paths_bf16(k, fmt, zero_point, group_size, kk, path):
    _check_launch(k, fmt, zero_point, group_size, kk, CONFIGS[path], torch.bfloat16, m=2)


def _check_launch(k, fmt, zero_point, group_size, kk, config, dtype, m):
    n = 200 if config["kernel"] == "dequant" else N  # two row chunks of 128
    qw = k.quantize(_weight(n, kk, dtype, seed=5), group_size=group_size, zero_point=zero_point, fmt=fmt)
    x = torch.randn(m, kk, generator=_gen(6)).to(dtype)
    bias = torch.randn(n, generator=_gen(7)).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)  # poisoned: every element must be written
    k.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, qw.codebook, bias, n, kk, group_size, config, out=out,
                            mins=qw.mins)
    assert not out.isnan().any()
    assert _rel_err(out, _reference(k, x, qw, bias)) < TOL[dtype]


def test_half2_gemv_applies_where_supported(k):
    """fp16 / bf16, int4 or NF4 with tile-sized (or per-channel; NF4 also 64-column) groups, and int4 groups of
    32 / 64 without zero points (symmetric or float minima), take the packed-fp16 GEMV; the rest does not."""
    tk = k.tuning
    x16, x_bf = torch.zeros(1, 256, dtype=torch.float16), torch.zeros(1, 256, dtype=torch.bfloat16)
    codebook = torch.zeros(16)
    assert all(tk.half2_supported(x, None, g, has_zeros=z) for g in (128, 256, -1) for x in (x16, x_bf)
               for z in (False, True))
    assert all(tk.half2_supported(x16, codebook, g) for g in (64, 128, -1))
    assert not tk.half2_supported(x16.float(), None, 128)
    assert all(tk.half2_supported(x, None, g, has_mins=mins) for g in (32, 64, 128) for x in (x16, x_bf)
               for mins in (False, True))
    assert not tk.half2_supported(x16, None, 64, has_zeros=True) and not tk.half2_supported(x16, None, 32, has_zeros=True)
    assert not tk.half2_supported(x16, None, -1, has_mins=True)
    assert not tk.half2_supported(x16, codebook, 32)
    assert k.tuning.heuristic(1, 4096, 4096, 132)["half2"]


def test_wgmma_config_runs_as_its_dot_config_off_hopper(k):
    """A dot config carrying a `wgmma` override resolves to the dot plan where the Gluon kernel cannot run (here:
    the interpreter), so a tuned table's wgmma entries never reach a GPU or format without it."""
    x = torch.zeros(64, 4096, dtype=torch.float16)
    config = {**k.tuning.heuristic(64, 4096, 4096, 132), "wgmma": {"block_m": 128}}
    assert not k.tuning.wgmma_supported(x, None, 128)
    plan = k.tuning.resolve(config, x, None, 128)
    assert plan["kernel"] == "dot" and plan["block_m"] == config["block_m"]


def test_mma_config_runs_as_the_config_beneath_off_gpu(k):
    """A GEMV or dot config carrying an `mma` override resolves to its own plan where the Gluon GEMV cannot run
    (here: the interpreter)."""
    x = torch.zeros(1, 4096, dtype=torch.float16)
    for m in (1, 16):
        config = {**k.tuning.heuristic(m, 4096, 4096, 132), "mma": {"num_warps": 4}}
        assert not k.tuning.mma_supported(x, None, 128)
        assert k.tuning.resolve(config, x, None, 128)["kernel"] == ("gemv_h2" if m == 1 else "dot")


def test_nf4_takes_its_own_tensor_core_tiles(k):
    """NF4 weights keep the int4 GEMV, dequantize and M <= 16 configs; above they run 8-warp tiles, 256 x 128
    where the group scales go on the operands (E3)."""
    for m in (1, 16, 64, 256, 1024):
        int4 = k.tuning.heuristic(m, 28672, 4096, 132)
        # the wgmma tiles apart (`test_nf4_takes_its_own_wgmma_tile`)
        nf4, int4 = ({key: value for key, value in c.items() if key != "wgmma"}
                     for c in (k.tuning.nf4_tiles(int4, m, 28672, 132, 64), int4))
        assert (nf4 == int4) == (m <= 16 or int4["kernel"] != "dot" or (m <= 64 and int4["block_n"] < 128))
    int4 = k.tuning.heuristic(256, 8192, 8192, 132)
    wide = k.tuning.nf4_tiles(int4, 256, 8192, 132, 64)
    assert (wide["block_m"], wide["block_n"], wide["num_warps"], wide["split_k"]) == (256, 128, 8, 2)
    assert wide["x_desc"] and wide["w_desc"]
    assert k.tuning.nf4_tiles(int4, 256, 8192, 132, -1)["block_m"] == 256
    assert k.tuning.nf4_tiles(int4, 256, 8192, 132, 128)["block_m"] == int4["block_m"]  # one scale per tile


def test_nf4_dequantizes_where_its_wide_tiles_leave_sms_idle(k):
    """At 65-511 tokens NF4 runs dequantize + cuBLAS where the 256 x 128 grid's waves keep under
    `NF4_MIN_WAVE_USE` of the SMs busy: 48 row tiles split in 2 fill 96 of 132 SMs, 160 fill 1.2 waves; 64 row
    tiles split in 2 fill 128, 224 fill 0.85 of two waves."""
    for n, want in ((6144, "dequant"), (10240, "dequant"), (8192, "dot"), (28672, "dot")):
        int4 = k.tuning.heuristic(256, n, 8192, 132)
        assert k.tuning.nf4_tiles(int4, 256, n, 132, 64)["kernel"] == want, n
    # two token tiles of 4096 rows split in 2 fill 128 SMs, one fills 64
    for m, want in ((256, "dequant"), (300, "dot")):
        assert k.tuning.nf4_tiles(k.tuning.heuristic(m, 4096, 4096, 132), m, 4096, 132, 64)["kernel"] == want
    assert k.tuning.select(64, 28672, 4096, torch.device("cpu"), nf4_group=64)["num_warps"] == 8


def test_nf4_takes_its_own_wgmma_tile(k):
    """An entry's int4 `wgmma` tile is not NF4's: at 129-1024 tokens NF4 takes `NF4_WGMMA` where the int4 config
    has one (E79), nowhere else; the entry's ``"nf4"`` keys override it, and int4 weights never see them."""
    wgmma = {"block_m": 128, "block_n": 256, "num_stages": 3}
    for m, n in ((256, 28672), (512, 6144), (1024, 8192), (200, 8192)):
        int4 = {**k.tuning.heuristic(m, n, 4096, 132), "wgmma": wgmma}
        nf4 = k.tuning.nf4_tiles(int4, m, n, 132, 64)
        assert nf4["wgmma"] == k.tuning.NF4_WGMMA, (m, n)
        without = k.tuning.nf4_tiles({key: v for key, v in int4.items() if key != "wgmma"}, m, n, 132, 64)
        assert "wgmma" not in without
        assert {key: v for key, v in nf4.items() if key != "wgmma"} == without
    for m in (64, 128, 1025, 4096):
        int4 = {**k.tuning.heuristic(m, 28672, 4096, 132), "wgmma": wgmma}
        assert "wgmma" not in k.tuning.nf4_tiles(int4, m, 28672, 132, 64), m
    int4 = {**k.tuning.heuristic(256, 28672, 4096, 132), "wgmma": wgmma}
    nf4_wgmma = {**wgmma, "split_k": 2}
    both = {**int4, "nf4": {"wgmma": nf4_wgmma}}
    assert k.tuning.nf4_tiles(both, 256, 28672, 132, 64)["wgmma"] == nf4_wgmma
    assert "nf4" not in k.tuning.nf4_tiles(both, 256, 28672, 132, 64)


def test_select_leaves_nf4_keys_to_nf4_weights(k, monkeypatch):
    """A table entry's ``"nf4"`` keys reach NF4 weights only: int4 gets the entry without them."""
    entry = {**k.tuning.heuristic(256, 4096, 4096, 132), "nf4": {"wgmma": {"block_m": 128}}}
    monkeypatch.setattr(k.tuning, "table", lambda name: {"shapes": {"4096x4096": {"256": entry}}})
    cpu = torch.device("cpu")
    assert "nf4" not in k.tuning.select(256, 4096, 4096, cpu)
    assert k.tuning.select(256, 4096, 4096, cpu)["kernel"] == entry["kernel"]
    assert k.tuning.select(256, 4096, 4096, cpu, nf4_group=64)["wgmma"] == {"block_m": 128}


def test_wgmma_split_fills_the_waves(k):
    """`wgmma_split` takes the split of the fewest tile steps: the tuned splits of the H100 table at their own M
    (runs 115-122) and of run 151's sweep, and more splits where a token tile count leaves a second wave mostly
    empty."""
    split = k.tuning.wgmma_split
    assert [split(m, 8192, 28672, 128, 256, 132) for m in (256, 512, 640, 1024)] == [2, 1, 4, 1]  # 70B down
    assert [split(m, 4096, 14336, 128, 256, 132) for m in (256, 512, 1024)] == [4, 2, 1]  # 8B down
    assert [split(m, 57344, 8192, 128, 256, 132) for m in (64, 256, 4096)] == [1, 1, 1]  # 70B gate_up
    assert split(4096, 4096, 4096, 128, 256, 132) == 1
    assert [split(m, 10240, 8192, 128, 256, 132) for m in (256, 512)] == [3, 2]  # 70B qkv (run 151: 3 the fastest)


def test_wgmma_tail_split_splits_only_what_the_last_wave_leaves(k):
    """`wgmma_tail_split` (``"split_k": "auto"``) keeps whole waves of row-tile columns unsplit and splits the rest;
    where the tiles fill their waves, every tile is split anyway, or two launches would save under 3 % of the
    steps, it is `wgmma_split`'s one launch."""
    tail = k.tuning.wgmma_tail_split
    assert tail(512, 10240, 8192, 128, 256, 132) == (33, 4)  # 70B qkv: 4 x 33 tiles whole, 4 x 7 in quarters
    assert tail(1024, 10240, 8192, 128, 256, 132) == (33, 2)  # 8 x 33 = 2 waves whole, 8 x 7 in halves
    assert tail(1024, 4096, 4096, 128, 256, 132) == (16, 1)  # 8B o: 128 tiles in one wave, nothing split
    assert tail(256, 4096, 4096, 128, 256, 132) == (0, 4)  # 32 tiles: every tile in quarters (`wgmma_split`)
    assert tail(256, 4096, 4096, 128, 256, 132)[1] == k.tuning.wgmma_split(256, 4096, 4096, 128, 256, 132)
    assert tail(4096, 57344, 8192, 128, 256, 132) == (224, 1)  # 70B gate_up: a 2 % saving is not taken


@pytest.mark.parametrize("bias", [False, True])
def test_split_reduction_writes_only_its_column_slice(k, bias):
    """The split-K reduction into a column slice of a wider output (the second launch of `wgmma_tail_split`):
    the slice gets the parts' sum in split order (+ its bias), every other element keeps its poison."""
    gen = _gen(4)
    m, n, first = 5, 300, 100
    part = torch.randn(3, m, n - first, generator=gen)
    bias_t = torch.randn(n, generator=gen).to(torch.float16) if bias else None
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    k.triton_kernels.launch._reduce_splits(part, None if bias_t is None else bias_t[first:], out[:, first:],
                                           n - first, False)
    want = part[0] + part[1] + part[2] + (bias_t[first:].float() if bias else 0)
    assert torch.equal(out[:, first:], want.to(torch.float16))
    assert out[:, :first].isnan().all()


def test_heuristic_takes_the_wgmma_tile_on_large_weights_above_256_tokens(k):
    """Untuned shapes run the 256-row wgmma tile with its split chosen per call from 257 tokens (129 where
    K >= 8192), on weights of 16M or more whose padded rows it divides; elsewhere (and off Hopper) the dot /
    dequantize config."""
    heuristic = k.tuning.heuristic
    for m in (300, 512, 1024, 1025, 4096):
        assert heuristic(m, 22016, 4096, 132)["wgmma"] == {"block_m": 128, "block_n": 256, "num_stages": 3,
                                                           "inflight": 2, "split_k": "auto"}
    assert heuristic(1024, 22016, 4096, 132)["kernel"] == "dequant"
    for m, n, kk in ((256, 22016, 4096), (64, 22016, 4096), (512, 1536, 8960), (4096, 1536, 8960),
                     (512, 6016, 4096), (128, 4096, 11008)):
        # M = 256 with K < 8192, small M, 13.8M weights, 6016 rows, one token tile
        assert "wgmma" not in heuristic(m, n, kk, 132), (m, n, kk)
    assert heuristic(129, 4096, 11008, 132)["wgmma"]["split_k"] == "auto"  # K >= 8192: from two token tiles


def test_nf4_heuristic_takes_the_long_row_gemv_from_k_4096(k):
    """At one token, untuned NF4 weights take the 2-warp 16-row TMA plan from K = 4096 (int4 from 8192), with 4096
    rows or more; shorter rows keep the 8 x 8 plan."""
    long_rows = {"block_n": 16, "tiles": 8, "split_k": 1, "num_warps": 2, "prefetch": False, "num_stages": 3,
                 "x_bcast": True, "tma": True}
    heuristic = k.tuning.heuristic
    assert heuristic(1, 22016, 4096, 132, nf4=True)["half2"] == long_rows
    assert heuristic(1, 22016, 4096, 132)["half2"] != long_rows
    assert heuristic(1, 22016, 8192, 132)["half2"] == long_rows
    assert heuristic(1, 17920, 1536, 132, nf4=True)["half2"]["num_warps"] == 4
    assert heuristic(1, 2048, 4096, 132, nf4=True)["half2"]["num_warps"] == 4
    cpu = torch.device("cpu")
    assert k.tuning.select(1, 22016, 4096, cpu, nf4_group=64)["half2"] == long_rows
    assert k.tuning.select(1, 22016, 4096, cpu)["half2"] != long_rows


def test_heuristic_runs_up_to_32_tokens_on_the_mma_gemv(k):
    """Untuned shapes take the mma GEMV up to 32 tokens (a 32-token tile above 16), the dot path above."""
    plans = {m: k.tuning.heuristic(m, 22016, 4096, 132).get("mma") for m in (1, 4, 16, 17, 32, 33, 64)}
    assert plans[1] is None and plans[33] is None and plans[64] is None
    assert all(plans[m].get("block_m", 8) <= 16 for m in (4, 16))
    assert plans[17]["block_m"] == plans[32]["block_m"] == 32


def test_nf4_runs_mma_entries_on_single_block_warps(k):
    """An mma entry with reps 2 (int4's) runs NF4 with the same rows per program on reps-1 warps, at most 4 of
    them; entries with reps 1 stay as they are."""
    dot = k.tuning.heuristic(16, 8192, 8192, 132)
    for mma, want in (({"num_warps": 2, "reps": 2, "tiles": 4}, {"num_warps": 4, "reps": 1, "tiles": 4}),
                      ({"num_warps": 4, "reps": 2, "tiles": 2}, {"num_warps": 4, "reps": 1, "tiles": 2}),
                      ({"num_warps": 4, "tiles": 4}, {"num_warps": 4, "tiles": 4})):
        assert k.tuning.nf4_tiles({**dot, "mma": mma}, 16, 8192, 132, 64)["mma"] == want


def test_gluon_kernels_only_on_the_triton_release_they_were_built_for(k, caplog, monkeypatch):
    """On a Triton release outside `GLUON_TRITON_RELEASES` (Gluon's API changes between releases: 3.9 removed the
    TMA copy names both Gluon kernels call) neither Gluon kernel applies, so plans fall back to the
    Triton-language kernels; one warning per kernel module says so."""
    import triton

    monkeypatch.setattr(triton, "__version__", "3.9.0")
    k.tuning._gluon_available.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not any(k.tuning._gluon_available(module) for module in ("mma", "wgmma", "mma", "wgmma"))
        messages = [r.getMessage() for r in caplog.records if "built for Triton" in r.getMessage()]
        assert len(messages) == 2 and all("3.9.0" in message for message in messages)
    finally:
        k.tuning._gluon_available.cache_clear()


def test_untuned_shapes_are_logged_once(k, caplog):
    """A GPU shape with no table entry runs the heuristic and says so, once per GPU and shape."""
    k.tuning._note_heuristic.cache_clear()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            k.tuning._note_heuristic("NVIDIA H200", 1536, 8960)
        k.tuning._note_heuristic("Some Other GPU", 1536, 8960)
    messages = [r.getMessage() for r in caplog.records if "no tuned launch config" in r.getMessage()]
    assert len(messages) == 2
    assert "1536 x 8960 on NVIDIA H200 (configs/nvidia-h200.json)" in messages[0]
    assert "no configs/some-other-gpu.json" in messages[1]


def test_shipped_tables_name_their_gpu_and_resolve(k):
    """Each configs/<gpu>.json is found under the name of the GPU it says it was measured on, says how (date,
    versions, command), and every entry of it resolves to a launch plan at the M of its bucket, with fp16 x and
    with bf16 x (which takes an entry's "bf16" override)."""
    paths = sorted(k.tuning.CONFIG_DIR.glob("*.json"))
    assert {p.stem for p in paths} >= {"nvidia-h200", "nvidia-h100-80gb-hbm3"}
    for path in paths:
        table = k.tuning.table(path.stem.replace("-", " "))  # the slug of "nvidia h200" is the file's stem
        assert table and k.tuning.table_path(table["device"]) == path
        assert table["measured"] and all({"date", "torch", "triton", "command"} <= set(m) for m in table["measured"])
        for shape, entry in table["shapes"].items():
            kk = int(shape.split("x")[1])
            for bucket, config in entry.items():
                for dtype in (torch.float16, torch.bfloat16):
                    x = torch.zeros(int(bucket), kk, dtype=dtype)
                    plan = k.tuning.resolve(config, x, None, 128)
                    assert plan["kernel"] in ("gemv", "gemv_h2", "dot", "dequant"), (path.name, shape, bucket, dtype)


def test_resolve_keeps_the_dependent_launch_choice(k):
    """A config's "pdl" reaches the plan of whichever kernel it resolves to (here the packed GEMV and the dot
    path), the tuned table keeps its one stream-ordered entry, and off the GPU no plan launches as a dependent."""
    x16 = torch.zeros(16, 4096, dtype=torch.float16)
    for m in (1, 16):
        config = {**k.tuning.heuristic(m, 4096, 4096, 132), "pdl": False}
        assert k.tuning.resolve(config, x16[:m], None, 128)["pdl"] is False
        assert "pdl" not in k.tuning.resolve(k.tuning.heuristic(m, 4096, 4096, 132), x16[:m], None, 128)
    table = k.tuning.table("NVIDIA H200")
    assert table["shapes"]["4096x14336"]["16"]["pdl"] is False
    assert not k.triton_kernels.launch.dependent_launch({"pdl": True}, x16.device)


def test_resolve_keeps_the_nf4_lookup_choice(k):
    """A config's "nf4_shfl" (NF4 looked up by warp shuffles) reaches the plan of whichever kernel it resolves to:
    the packed GEMV's beneath its "half2" tiles, and the mma GEMV's beneath its "mma" ones on a GPU (here, without
    one, the dot path's, which ignores it)."""
    x16 = torch.zeros(16, 4096, dtype=torch.float16)
    gemv = {"kernel": "gemv", "block_n": 8, "tiles": 8, "half2": {"num_warps": 2}, "nf4_shfl": True}
    dot = {"kernel": "dot", "block_m": 16, "block_n": 64, "packed": True, "mma": {"num_warps": 4}, "nf4_shfl": True}
    assert k.tuning.resolve(gemv, x16[:1], None, 128)["nf4_shfl"] is True
    assert k.tuning.resolve(dot, x16, None, 128)["nf4_shfl"] is True
    assert "nf4_shfl" not in k.tuning.resolve(k.tuning.heuristic(1, 4096, 4096, 132), x16[:1], None, 128)


def test_resolve_takes_a_bf16_override_for_bf16_activations_only(k):
    """A config's "bf16" keys replace its own for bf16 x (here: the fp32 GEMV instead of the packed one) and are
    dropped for fp16 x; a "bf16" that is not a dict is refused by name."""
    config = {"kernel": "gemv", "block_n": 8, "tiles": 8, "half2": True, "bf16": {"half2": False, "tiles": 4}}
    x = torch.zeros(1, 4096)
    fp16 = k.tuning.resolve(config, x.half(), None, 128)
    bf16 = k.tuning.resolve(config, x.bfloat16(), None, 128)
    assert fp16["kernel"] == "gemv_h2" and fp16["tiles"] == 8 and "bf16" not in fp16
    assert bf16["kernel"] == "gemv" and bf16["tiles"] == 4 and "bf16" not in bf16
    with pytest.raises(ValueError, match='"bf16"'):
        k.tuning.resolve({**config, "bf16": True}, x.half(), None, 128)


@pytest.mark.parametrize("half2", [{"pdl_trigger": "start"}, {"pdl_trigger": "start", "split_k": 2}])
def test_pdl_trigger_keeps_the_bits(k, monkeypatch, half2):
    """E66's "pdl_trigger" (the next kernel let launch at the packed GEMV's start) reaches the launcher through
    `resolve` and changes no bit: nothing launches as a dependent off the GPU, so this checks the plumbing; the
    GPU's dependent-launch chains check the ordering."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    qw = k.quantize(_weight(96, 384), group_size=128)
    x = torch.randn(2, 384, generator=_gen(3)).half()
    base = {"kernel": "gemv", "block_n": 32, "tiles": 1, "half2": {"block_n": 32, "tiles": 1, "num_stages": 2,
                                                                  "x_bcast": True, "tma": True}}
    plan = {**base, "half2": {**base["half2"], **half2}}
    resolved = k.tuning.resolve(plan, x, None, 128)
    assert resolved["kernel"] == "gemv_h2" and resolved.items() >= half2.items()
    want = k.triton_kernels.matmul(x, qw.qweight, qw.scales, None, None, None, 96, 384, 128, base)
    assert torch.equal(k.triton_kernels.matmul(x, qw.qweight, qw.scales, None, None, None, 96, 384, 128, plan), want)


@pytest.mark.parametrize("trigger", ["middle", True])
def test_pdl_trigger_checked(k, monkeypatch, trigger):
    """A malformed "pdl_trigger" is refused by name before any launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    qw = k.quantize(_weight(96, 384), group_size=128)
    plan = {"kernel": "gemv", "block_n": 32, "tiles": 1, "half2": {"block_n": 32, "tiles": 1, "pdl_trigger": trigger}}
    with pytest.raises(ValueError, match="pdl_trigger"):
        k.triton_kernels.matmul(torch.randn(1, 384).half(), qw.qweight, qw.scales, None, None, None, 96, 384, 128,
                                plan)


def test_static_shared_memory_hook_chains_or_declines(k, monkeypatch):
    """The NF4 pair table's load hook is installed in front of any hook already there (which it calls on), and
    where this Triton has no load hook the table is declined (the GEMVs keep the PRMT lookup)."""
    import types

    from triton import knobs

    allow = k.triton_kernels.launch._allow_static_shared_memory.__wrapped__
    monkeypatch.setattr(knobs, "runtime", types.SimpleNamespace(kernel_load_end_hook="previous"))
    assert allow() and knobs.runtime.kernel_load_end_hook != "previous"
    assert "previous" in [cell.cell_contents for cell in knobs.runtime.kernel_load_end_hook.__closure__]
    monkeypatch.setattr(knobs, "runtime", types.SimpleNamespace())
    assert not allow()


def test_dot_takes_the_pair_table_that_keeps_its_programs_an_sm(k, monkeypatch):
    """The dot path's NF4 lookup (E75, run 184): the whole pair table where it leaves the programs an SM as they
    are, else the half table, else the byte permutes; a plan's "nf4_smem" / "nf4_table_copies" pin it, still only
    where the table fits (3 stages of a 256 x 128 tile and the whole table do not: that launch failed, run 179);
    int4 never. The shared memory counted is what sm_90a compiles allocate (x's tile in every stage, the words' in
    all but one)."""
    launch = k.triton_kernels.launch
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(launch, "_allow_static_shared_memory", lambda: True)
    monkeypatch.setattr(launch, "_shared_memory_per_block", lambda index: 232448)  # the H100 / H200 opt-in limit
    monkeypatch.setattr(launch, "_shared_memory_per_sm", lambda index: 233472)
    x, codebook = torch.zeros(64, 4096, dtype=torch.float16), torch.zeros(16)

    def lookup(**plan):
        flags = launch._dot_nf4_table_flags({"nf4_tables": True, "num_stages": 3, **plan}, codebook, x)
        return {True: "whole", 16: "half", None: "permutes"}[flags.get("NF4_SMEM")]

    # 57 KB: 3 programs an SM, 2 beside the whole table, 3 beside the half
    assert lookup(block_m=64, block_n=64, num_warps=4) == "half"
    # 8 warps: the registers allow 2 programs, and so does the whole table
    assert lookup(block_m=64, block_n=128, num_warps=8) == "whole"
    # 4 stages, 90 KB: 2 programs, 1 beside the whole table
    assert lookup(block_m=64, block_n=128, num_warps=8, num_stages=4) == "half"
    # 115 KB: 2 programs, 1 beside either table
    assert lookup(block_m=128, block_n=128, num_warps=8) == "permutes"
    assert lookup(block_m=64, block_n=64, num_warps=4, nf4_smem=False) == "permutes"
    assert lookup(block_m=64, block_n=64, num_warps=4, nf4_table_copies=32) == "whole"
    assert lookup(block_m=128, block_n=128, num_warps=8, nf4_table_copies=16) == "half"
    large = {"block_m": 256, "block_n": 128, "num_warps": 8}  # 213 KB at 3 stages, 139 KB at 2
    assert lookup(**large, nf4_table_copies=32) == "permutes"
    assert lookup(**large) == "half"
    assert lookup(**large, num_stages=2) == "whole"
    assert launch._dot_nf4_table_flags({"nf4_tables": True, "block_m": 64, "block_n": 64}, None, x) == {}
    assert launch._dot_nf4_table_flags({"block_m": 64, "block_n": 64}, codebook, x) == {}  # not NF4's plan
    with pytest.raises(ValueError, match="nf4_table_copies"):
        lookup(block_m=64, block_n=64, num_warps=4, nf4_table_copies=8)


@pytest.mark.parametrize("per_sm", [0, True, 1.5])
def test_persistent_checked(k, per_sm):
    """A "persistent" that is not a positive count is refused by name."""
    with pytest.raises(ValueError, match="persistent"):
        k.triton_kernels.launch._persistent_grid({"persistent": per_sm}, (4, 2, 1), torch.device("cpu"))


@pytest.mark.parametrize("cap", [0, True, 96.0, 256, "96"])
def test_register_cap_checked(k, cap):
    """A "maxnreg" that is not a register count ptxas takes is refused by name before a launch."""
    with pytest.raises(ValueError, match="maxnreg"):
        k.triton_kernels.launch._register_cap({"maxnreg": cap})


def test_register_cap_reaches_the_one_token_gemv(k, monkeypatch):
    """The half2 GEMV plan's "maxnreg" is the launch's (and only given where the plan names it); the result is
    checked against the float64 reference."""
    launch = k.triton_kernels.launch
    seen = []
    kernel = launch._gemv_h2_kernel

    class Recording:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append(kwargs.get("maxnreg"))
                return kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(launch, "_gemv_h2_kernel", Recording())
    qw = k.quantize(_weight(N, 256, seed=41), group_size=64, fmt="nf4")
    x = torch.randn(1, 256, generator=_gen(42)).half()
    for plan, cap in (({"kernel": "gemv", "block_n": 32, "tiles": 2, "split_k": 1, "half2": {"maxnreg": 96}}, 96),
                      ({"kernel": "gemv", "block_n": 32, "tiles": 2, "split_k": 1, "half2": True}, None)):
        got = k.triton_kernels.matmul(x, qw.qweight, qw.scales, None, qw.codebook, None, N, 256, 64, plan)
        assert seen[-1] == cap
        assert _rel_err(got, _reference(k, x, qw)) < TOL[torch.float16]


def test_nf4_lookup_choice_is_checked(k):
    """"nf4_shfl" takes true, false or "half"; anything else is refused by name before a launch."""
    with pytest.raises(ValueError, match="nf4_shfl"):
        k.triton_kernels.launch._nf4_shuffled_halves({"nf4_shfl": "all"}, torch.zeros(16))
    assert k.triton_kernels.launch._nf4_shuffled_halves({"nf4_shfl": True}, None) == 0  # int4: no lookup
    with pytest.raises(ValueError, match="nf4_smem"):
        k.triton_kernels.launch._nf4_table_flags({"nf4_smem": "yes"}, torch.zeros(16))
    with pytest.raises(ValueError, match="nf4_smem and nf4_shfl"):
        k.triton_kernels.launch._nf4_table_flags({"nf4_smem": True, "nf4_shfl": "half"}, torch.zeros(16))
    assert k.triton_kernels.launch._nf4_table_flags({"nf4_smem": True}, None) == {}  # int4: no table


def test_resolve_makes_every_choice_once(k):
    """A config becomes the plan the launchers run: the packed GEMV's own tiles where it applies, the portable
    GEMV elsewhere; packed dot operands only for int4 with tile-sized groups."""
    x16 = torch.zeros(1, 256, dtype=torch.float16)
    gemv = {"kernel": "gemv", "block_n": 8, "tiles": 4, "split_k": 2, "num_warps": 4,
            "half2": {"block_n": 16, "tiles": 8, "split_k": 1}}
    assert k.tuning.resolve(gemv, x16, None, 128) == {"kernel": "gemv_h2", "block_n": 16, "tiles": 8, "split_k": 1,
                                                       "num_warps": 4}
    assert k.tuning.resolve(gemv, x16, None, 32, has_zeros=True) == {"kernel": "gemv", "block_n": 8, "tiles": 4,
                                                                      "split_k": 2, "num_warps": 4}
    assert k.tuning.resolve(gemv, x16, None, 32, has_mins=True)["kernel"] == "gemv_h2"
    assert k.tuning.resolve({**gemv, "half2": True}, x16, None, 128)["kernel"] == "gemv_h2"
    dot = {"kernel": "dot", "block_m": 16, "block_n": 64, "packed": True}
    assert k.tuning.resolve(dot, x16, None, 128)["packed"] and k.tuning.resolve(dot, x16, None, -1)["packed"]
    assert not k.tuning.resolve(dot, x16, None, 64)["packed"]
    tma = {**dot, "x_desc": True, "w_desc": True}
    assert k.tuning.resolve(tma, x16, None, 128)["x_desc"]
    odd = torch.zeros(2, 129, dtype=torch.float16)[:, :127]  # rows of 258 bytes: not 16-byte aligned for TMA
    assert not k.tuning.resolve(tma, odd, None, 128)["x_desc"] and k.tuning.resolve(tma, odd, None, 128)["w_desc"]
    nf4 = k.tuning.resolve(dot, x16, torch.zeros(16), 128)
    assert not nf4["packed"] and not nf4["nf4_tables"]  # not a full-tile config
    # packed fp16 scalings by inline PTX: NVIDIA GPUs only (the interpreter scales in fp32)
    assert not k.tuning.resolve({**dot, "full_tile": True}, x16, torch.zeros(16), 64)["nf4_half_scale"]
    assert k.tuning.resolve({**dot, "full_tile": True}, x16, torch.zeros(16), 128)["nf4_tables"]  # emulated here
    assert not k.tuning.resolve({**dot, "full_tile": True}, x16, None, 128)["nf4_tables"]


def test_bf16_activations_to_fp16_per_tile(k):
    """The bf16 -> fp16 pre-pass of the packed GEMV: tiles whose largest |x| spans 1e-30 to 1e30 (beyond fp16's
    range either way) come out exact after undoing each tile's power-of-two scale, and the K tail is ignored."""
    tk = k.triton_kernels.gemv
    kk = 5 * 128 + 40
    x = torch.randn(2, kk, generator=_gen(15))
    for t, magnitude in enumerate([1e-30, 1e-3, 1.0, 3e4, 1e30, 0.0]):
        x[:, t * 128:(t + 1) * 128] *= magnitude
    x = x.to(torch.bfloat16)
    tiles = -(-kk // 128)
    x16 = torch.full((2, kk), float("nan"), dtype=torch.float16)
    xs = torch.full((2, tiles), float("nan"))
    tk._x_to_fp16_kernel[(2, 1)](x, x16, xs, kk, tiles, x.stride(0), x16.stride(0), TILES=8, PDL=False)
    assert torch.isfinite(x16).all() and torch.isfinite(xs).all()
    largest = x16.float().abs().view(2, -1)[:, :5 * 128].view(2, 5, 128).amax(-1)
    assert ((largest >= 1024) & (largest < 2048)).all()
    restored = x16.float() * xs.repeat_interleave(128, dim=1)[:, :kk]
    assert torch.equal(restored, x.float())


@pytest.mark.parametrize("zero_point", [False, True])
def test_half2_gemv_large_activations(k, zero_point):
    """The packed-fp16 GEMV divides codes by 16 so that |x| in the thousands stays finite (emulated here; the
    GPU test runs the PTX)."""
    kk = 512
    qw = k.quantize(_weight(N, kk, seed=13), group_size=128, zero_point=zero_point)
    x = (torch.randn(1, kk, generator=_gen(14)) * 3000).half()
    config = {"kernel": "gemv", "block_n": 64, "tiles": 4, "split_k": 1, "half2": True}
    out = k.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, qw.codebook, None, N, kk, 128, config)
    assert out.isfinite().all()
    assert _rel_err(out, _reference(k, x, qw)) < TOL[torch.float16]


@pytest.mark.parametrize("group_size", [128, -1])
def test_half2_gemv_any_uint8_zero_point(k, group_size):
    """The packed GEMV makes its zero-point pairs from the integer zero points by integer arithmetic (exact for
    every uint8, not only the 0-16 of real checkpoints): zero points over 0-255, against float64 from the codes."""
    n, kk = N, 384
    codes = torch.randint(0, 16, (n, kk), generator=_gen(40), dtype=torch.uint8)
    groups = 1 if group_size == -1 else kk // group_size
    zeros = torch.randint(0, 256, (groups, n), generator=_gen(41), dtype=torch.uint8)
    scales = (torch.rand(groups, n, generator=_gen(42)) * 1e-3 + 1e-4).half()
    qw = k.formats.from_codes(codes, scales, zeros, group_size=group_size, fmt="int4", dtype=torch.float16)
    x = torch.randn(1, kk, generator=_gen(43)).half()
    dense = (codes.double() - zeros.double().repeat_interleave(kk // groups, 0).t()) \
        * scales.double().repeat_interleave(kk // groups, 0).t()
    config = {"kernel": "gemv", "block_n": 8, "tiles": 4, "split_k": 1, "half2": True}
    out = k.triton_kernels.matmul(x, qw.qweight, qw.scales, qw.zeros, qw.codebook, None, n, kk, group_size, config)
    assert _rel_err(out, x.double() @ dense.t()) < TOL[torch.float16]


@pytest.mark.parametrize("m", [1, 5, 40, 600])
def test_public_matmul_dispatches_by_m(k, m):
    """Through the op: M=1 GEMV, small M the tl.dot path, large M dequantize + matmul (interpreter)."""
    qw = k.quantize(_weight(N, 384, seed=8), group_size=128, zero_point=True)
    x = torch.randn(m, 384, generator=_gen(9)).half()
    out = k.matmul(x, qw)
    assert out.shape == (m, N) and out.dtype == torch.float16
    assert _rel_err(out, _reference(k, x, qw)) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt,zero_point,group_size,kk", FORMATS, ids=FORMAT_IDS)
def test_pytorch_path(k, torch_path, fmt, zero_point, group_size, kk, dtype):
    qw = k.quantize(_weight(N, kk, dtype, seed=10), group_size=group_size, zero_point=zero_point, fmt=fmt)
    x = torch.randn(2, 3, kk, generator=_gen(11)).to(dtype)
    bias = torch.randn(N, generator=_gen(12)).to(dtype)
    out = k.matmul(x, qw, bias)
    assert out.shape == (2, 3, N) and out.dtype == dtype
    assert _rel_err(out, _reference(k, x, qw, bias)) < TOL[dtype]


def test_matmul_with_no_tokens(k):
    qw = k.quantize(_weight(N, 384), group_size=128)
    assert k.matmul(torch.empty(0, 384, dtype=torch.float16), qw).shape == (0, N)


def test_ops_pass_opcheck(k, torch_path):
    qw = k.quantize(_weight(N, 256, seed=13), group_size=64, zero_point=True)
    x = torch.randn(3, 256, generator=_gen(14)).half()
    args = (x, qw.qweight, qw.scales, qw.zeros, qw.mins, qw.codebook, qw.perm, None, N, 256, 64)
    torch.library.opcheck(k.ops.matmul_op, args)
    torch.library.opcheck(k.ops.dequantize_op, (qw.qweight, qw.scales, qw.zeros, qw.mins, qw.codebook, qw.perm, N,
                                                256, 64, torch.float32))


def test_gradient_wrt_x(k, torch_path):
    qw = k.quantize(_weight(N, 256, torch.float32, seed=15), group_size=64)
    x = torch.randn(4, 256, generator=_gen(16)).half().requires_grad_()
    bias = torch.randn(N, generator=_gen(17)).half().requires_grad_()
    grad = torch.randn(4, N, generator=_gen(18)).half()
    k.matmul(x, qw, bias).backward(grad)
    weight = k.dequantize(qw, torch.float32).double()
    assert _rel_err(x.grad, grad.double() @ weight) < 3e-3
    assert torch.allclose(bias.grad.double(), grad.double().sum(0), rtol=1e-2, atol=1e-2)


# --- the SwiGLU epilogue: a fused gate / up weight in the interleaved layout -------------------------------

INTER = 72  # intermediate size: 144 fused rows padded to 256, so a 128-row tile ends past N (masked columns)
SWIGLU_CONFIGS = {  # every path with the epilogue; resolve turns the GEMVs' 8-row tiles into 16-row ones
    "gemv-half2": {"kernel": "gemv", "block_n": 8, "tiles": 2, "split_k": 1, "half2": True},
    "gemv-half2-split": {"kernel": "gemv", "block_n": 32, "tiles": 1, "split_k": 2, "prefetch": True, "half2": True},
    "gemv-half2-tma": {"kernel": "gemv", "block_n": 16, "tiles": 2, "split_k": 1, "num_stages": 3, "x_bcast": True,
                       "tma": True, "half2": True},
    "gemv": {"kernel": "gemv", "block_n": 8, "tiles": 2, "split_k": 1},
    "gemv-split": {"kernel": "gemv", "block_n": 128, "tiles": 1, "split_k": 2, "prefetch": True},
    "dot-swap-packed": {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 1, "swap_ab": True, "packed": True},
    "dot-swap-full-split": {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 2, "swap_ab": True,
                            "full_tile": True},
    "dot-planes": {"kernel": "dot", "block_m": 16, "block_n": 128, "split_k": 1},
    "dot-packed": {"kernel": "dot", "block_m": 16, "block_n": 32, "split_k": 1, "packed": True},
    "dot-packed-tma-split": {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 2, "swap_ab": True,
                             "packed": True, "x_desc": True, "w_desc": True},
    "dequant-chunks": {"kernel": "dequant", "chunk_n": 128},
}
# int4 symmetric and zero-point g128 (the packed-fp16 GEMV, packed dot operands), g64 (portable GEMV, fp32 planes),
# per channel, NF4
SWIGLU_FORMATS = [FORMATS[i] for i in (0, 1, 3, 5, 6)]
SWIGLU_FORMAT_IDS = [FORMAT_IDS[i] for i in (0, 1, 3, 5, 6)]


def _gate_up(k, fmt, zero_point, group_size, kk, dtype, seed=50, inter=INTER):
    """Separately quantized gate and up weights [inter, K], their biases, and the fused weight in the SwiGLU layout."""
    gate, up = (k.quantize(_weight(inter, kk, dtype, seed=seed + i), group_size=group_size, zero_point=zero_point,
                           fmt=fmt) for i in range(2))
    biases = [torch.randn(inter, generator=_gen(seed + 2 + i)).to(dtype) for i in range(2)]
    fused, bias = k.fusion.interleave_gate_up(k.fusion.concat_weights([gate, up]), torch.cat(biases))
    return gate, up, biases, fused, bias


def _swiglu_reference(k, x, gate, up, biases):
    """float64 silu(x @ Wg.T + bg) * (x @ Wu.T + bu) from the separately dequantized weights."""
    g, u = (_reference(k, x, w, b) for w, b in zip((gate, up), biases))
    return torch.nn.functional.silu(g) * u


def test_swiglu_layout(k):
    """join_gate_up puts gate column 8 b + i at 16 b + i and up's at 16 b + 8 + i; split_gate_up inverts it; the
    interleaved weight dequantizes to the separate weights' rows in that order."""
    ref = k.reference
    gate, up = torch.arange(16).view(1, 16), torch.arange(100, 116).view(1, 16)
    joined = ref.join_gate_up(gate, up)
    assert joined.tolist() == [list(range(8)) + list(range(100, 108)) + list(range(8, 16)) + list(range(108, 116))]
    assert all(torch.equal(a, b) for a, b in zip(ref.split_gate_up(joined), (gate, up)))
    g, u, _, fused, _ = _gate_up(k, "int4", True, 64, 320, torch.float16)
    rows = ref.split_gate_up(k.dequantize(fused, torch.float32).t())
    assert torch.equal(rows[0], k.dequantize(g, torch.float32).t())
    assert torch.equal(rows[1], k.dequantize(u, torch.float32).t())


@pytest.mark.parametrize("path", list(SWIGLU_CONFIGS))
@pytest.mark.parametrize("fmt,zero_point,group_size,kk", SWIGLU_FORMATS, ids=SWIGLU_FORMAT_IDS)
def test_swiglu_paths_fp16(k, fmt, zero_point, group_size, kk, path):
    _check_swiglu_launch(k, fmt, zero_point, group_size, kk, SWIGLU_CONFIGS[path], torch.float16)


@pytest.mark.parametrize("path", list(SWIGLU_CONFIGS))
def test_swiglu_paths_bf16(k, path):
    _check_swiglu_launch(k, "int4", True, 128, 384, SWIGLU_CONFIGS[path], torch.bfloat16)


def _check_swiglu_launch(k, fmt, zero_point, group_size, kk, config, dtype):
    """silu(gate) * up [M, I] of one explicit launch on a NaN-poisoned output against float64. The epilogue runs on
    the fp32 accumulators and rounds once, as the matmul does, so the matmul's tolerance holds (silu(g) * u has
    the relative error of u plus |1 + g (1 - sigmoid(g))| times that of g, which exceeds 1 only where silu(g) is
    small); dequantize + cuBLAS rounds g and u to x's dtype first, about one more rounding (~3e-4 for fp16)."""
    m = 3 if config["kernel"] == "gemv" else 17  # two token tiles of 16 on the dot path
    gate, up, biases, fused, bias = _gate_up(k, fmt, zero_point, group_size, kk, dtype)
    x = torch.randn(m, kk, generator=_gen(6)).to(dtype)
    out = torch.full((m, INTER), float("nan"), dtype=dtype)
    k.triton_kernels.matmul(x, fused.qweight, fused.scales, fused.zeros, fused.codebook, bias, 2 * INTER, kk,
                            group_size, config, out=out, swiglu=True)
    assert not out.isnan().any()
    assert _rel_err(out, _swiglu_reference(k, x, gate, up, biases)) < TOL[dtype]


def test_resolve_pairs_gate_up_rows_for_swiglu(k):
    """With the epilogue every program holds whole 16-row blocks: the GEMVs' 8-row tiles (their own or the packed
    GEMV's) become 16 with half the K-tiles (the same words per thread), larger tiles and the other paths keep
    theirs; without it the plan is unchanged."""
    x16 = torch.zeros(1, 256, dtype=torch.float16)
    gemv = {"kernel": "gemv", "block_n": 8, "tiles": 4, "split_k": 2, "num_warps": 4,
            "half2": {"block_n": 8, "tiles": 8, "split_k": 1}}
    resolve = k.tuning.resolve
    assert resolve(gemv, x16, None, 128, swiglu=True) == {**resolve(gemv, x16, None, 128), "block_n": 16, "tiles": 4,
                                                          "swiglu": True}
    portable = dict(has_zeros=True)  # int4 groups of 32 with zero points: the portable GEMV
    assert resolve(gemv, x16, None, 32, swiglu=True, **portable) == {**resolve(gemv, x16, None, 32, **portable),
                                                                     "block_n": 16, "tiles": 2, "swiglu": True}
    assert resolve({**gemv, "block_n": 64}, x16, None, 32, swiglu=True, **portable)["block_n"] == 64
    for config in ({"kernel": "dot", "block_m": 16, "block_n": 64, "packed": True},
                   {"kernel": "dequant", "chunk_n": 8}):
        assert resolve(config, x16, None, 128, swiglu=True) == {**resolve(config, x16, None, 128), "swiglu": True}
    assert "swiglu" not in resolve(gemv, x16, None, 128)


@pytest.mark.parametrize("m", [1, 5, 40, 600])
def test_public_swiglu_matmul_dispatches_by_m(k, m):
    """Through the op (interpreter): M = 1 the packed-fp16 GEMV, then the dot path, large M dequantize + cuBLAS."""
    gate, up, biases, fused, bias = _gate_up(k, "int4", False, 128, 384, torch.float16, seed=60)
    x = torch.randn(m, 384, generator=_gen(9)).half()
    out = k.swiglu_matmul(x, fused, bias)
    assert out.shape == (m, INTER) and out.dtype == torch.float16
    assert _rel_err(out, _swiglu_reference(k, x, gate, up, biases)) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt,zero_point,group_size,kk", SWIGLU_FORMATS, ids=SWIGLU_FORMAT_IDS)
def test_swiglu_pytorch_path(k, torch_path, fmt, zero_point, group_size, kk, dtype):
    gate, up, biases, fused, bias = _gate_up(k, fmt, zero_point, group_size, kk, dtype, seed=61)
    x = torch.randn(2, 3, kk, generator=_gen(11)).to(dtype)
    out = k.swiglu_matmul(x, fused, bias)
    assert out.shape == (2, 3, INTER) and out.dtype == dtype
    assert _rel_err(out, _swiglu_reference(k, x, gate, up, biases)) < TOL[dtype]
    assert k.swiglu_matmul(x[:, :0], fused).shape == (2, 0, INTER)


def test_swiglu_op_passes_opcheck(k, torch_path):
    _, _, _, fused, bias = _gate_up(k, "int4", True, 64, 256, torch.float16, seed=62)
    x = torch.randn(3, 256, generator=_gen(14)).half().requires_grad_()
    args = (x, fused.qweight, fused.scales, fused.zeros, fused.mins, fused.codebook, fused.perm, bias, 2 * INTER, 256, 64)
    torch.library.opcheck(k.ops.swiglu_matmul_op, args)


def test_swiglu_gradient_wrt_x_and_bias(k, torch_path):
    """The backward recomputes the fused rows and differentiates silu(g) * u in fp32: against float64 autograd."""
    _, _, _, fused, bias = _gate_up(k, "int4", False, 64, 256, torch.float32, seed=63)
    x = torch.randn(4, 256, generator=_gen(16)).half().requires_grad_()
    bias = bias.half().requires_grad_()
    grad = torch.randn(4, INTER, generator=_gen(18)).half()
    k.swiglu_matmul(x, fused, bias).backward(grad)
    x64, b64 = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    gate, up = k.reference.split_gate_up(x64 @ k.dequantize(fused, torch.float32).double().t() + b64)
    (torch.nn.functional.silu(gate) * up).backward(grad.double())
    assert _rel_err(x.grad, x64.grad) < 3e-3 and _rel_err(bias.grad, b64.grad) < 3e-3


def test_swiglu_refuses_rows_that_do_not_pair(k):
    """Gate and up pair in blocks of 8 rows: 2 I must be a multiple of 16."""
    x = torch.randn(2, 256).half()
    odd = k.quantize(_weight(N, 256), group_size=128)  # 72 rows: I = 36
    with pytest.raises(ValueError, match="multiple of 16"):
        k.swiglu_matmul(x, odd)
    with pytest.raises(ValueError, match="multiple of 16"):
        k.W4A16Linear(odd).swiglu(x)
    with pytest.raises(ValueError, match="multiple of 16"):
        k.fusion.interleave_gate_up(odd)
    with pytest.raises(TypeError, match="qweight"):
        k.swiglu_matmul(x, odd.qweight)
    with pytest.raises(TypeError, match="gate_up"):
        k.fusion.interleave_gate_up(odd.qweight)


# --- importers: tensors built as the checkpoint tools build them ----------------------------------------

def _gptq_tensors(kk, n, g, zeros, seed):
    """AutoGPTQ layout: qweight [K/8, N] packed along K (natural nibble order), qzeros [G, N/8] packed
    along N, scales [G, N]; `zeros` holds what the checkpoint stores."""
    codes = torch.randint(0, 16, (kk, n), generator=_gen(seed))
    scales = (torch.rand(kk // g, n, generator=_gen(seed + 1)) * 0.01 + 1e-3).half()
    return codes, _pack_along(codes, 0), _pack_along(zeros, 1), scales


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_zero_point_conventions(k, torch_path, checkpoint_format):
    kk, n, g = 256, 48, 64
    real_zeros = torch.randint(1, 16, (kk // g, n), generator=_gen(20))  # v1 cannot store a zero of 0
    stored = real_zeros - 1 if checkpoint_format == "gptq" else real_zeros
    codes, qweight, qzeros, scales = _gptq_tensors(kk, n, g, stored, seed=21)
    qw = k.from_gptq(qweight, qzeros, scales, sym=False, checkpoint_format=checkpoint_format)
    group = torch.arange(kk) // g
    want = (codes - real_zeros[group]).double() * scales.double()[group]  # [K, N]
    assert torch.equal(k.dequantize(qw, torch.float32).double(), want.t().float().double())


def test_gptq_symmetric_v1_and_v2_and_mixups(k, torch_path):
    kk, n, g = 256, 48, 128
    for fmt, stored in (("gptq", 7), ("gptq_v2", 8)):
        codes, qweight, qzeros, scales = _gptq_tensors(kk, n, g, torch.full((kk // g, n), stored), seed=22)
        qw = k.from_gptq(qweight, qzeros, scales, checkpoint_format=fmt)
        assert qw.zeros is None
        want = (codes - 8).double() * scales.double()[torch.arange(kk) // g]
        assert torch.equal(k.dequantize(qw, torch.float32).double(), want.t().float().double())
    # v1 tensors read as v2 (or the reverse) shift every weight by one step: refused under sym=True.
    _, qweight, qzeros, scales = _gptq_tensors(kk, n, g, torch.full((kk // g, n), 7), seed=23)
    with pytest.raises(ValueError, match="gptq_v2"):
        k.from_gptq(qweight, qzeros, scales, checkpoint_format="gptq_v2")


@pytest.mark.parametrize("triton", [True, False], ids=["interpreter", "pytorch"])
def test_gptq_act_order(k, monkeypatch, triton):
    if not triton:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    kk, n, g = 384, 40, 128
    real_zeros = torch.randint(0, 16, (kk // g, n), generator=_gen(24))
    codes, qweight, qzeros, scales = _gptq_tensors(kk, n, g, real_zeros, seed=25)
    g_idx = (torch.randperm(kk, generator=_gen(26)) // g).int()  # desc_act: groups scattered over K
    qw = k.from_gptq(qweight, qzeros, scales, g_idx, sym=False, checkpoint_format="gptq_v2")
    assert qw.perm is not None
    weight = (codes - real_zeros[g_idx.long()]).double() * scales.double()[g_idx.long()]  # [K, N]
    assert torch.allclose(k.dequantize(qw, torch.float32).double(), weight.t(), rtol=0, atol=1e-6)
    x = torch.randn(3, kk, generator=_gen(27)).half()
    assert _rel_err(k.matmul(x, qw), x.double() @ weight) < TOL[torch.float16]


def test_gptq_trivial_g_idx_needs_no_permutation(k):
    _, qweight, qzeros, scales = _gptq_tensors(256, 16, 128, torch.full((2, 16), 7), seed=28)
    qw = k.from_gptq(qweight, qzeros, scales, (torch.arange(256) // 128).int())
    assert qw.perm is None


def test_awq_nibble_order_and_packing_axis(k, torch_path):
    kk, n, g = 256, 64, 128
    codes = torch.randint(0, 16, (kk, n), generator=_gen(30))  # AutoAWQ's intweight, [K, N]
    zeros = torch.randint(0, 16, (kk // g, n), generator=_gen(31))
    scales = (torch.rand(kk // g, n, generator=_gen(32)) * 0.01 + 1e-3).half()
    awq_order = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM packing: nibble i <- column 8c + order[i]
    qw = k.from_awq(_pack_along(codes, 1, awq_order), _pack_along(zeros, 1, awq_order), scales)
    group = torch.arange(kk) // g
    want = (codes - zeros[group]).double() * scales.double()[group]
    assert torch.equal(k.dequantize(qw, torch.float32).double(), want.t().float().double())
    # The same codes packed in natural nibble order are a different checkpoint: the order is read, not assumed.
    natural = k.from_awq(_pack_along(codes, 1), _pack_along(zeros, 1), scales)
    assert not torch.equal(k.dequantize(natural), k.dequantize(qw))


def _bnb_quantize(w: torch.Tensor, blocksize: int, codebook: torch.Tensor):
    """bitsandbytes' NF4 layout: blocks over the flattened weight, absmax per block (fp32), nearest code,
    two codes per byte with the first in the high nibble, storage [N*K/2, 1] uint8."""
    flat = w.float().reshape(-1, blocksize)
    absmax = flat.abs().amax(1)
    normalized = (flat / absmax[:, None]).clamp(-1, 1).reshape(-1)
    codes = (normalized[:, None] - codebook).abs().argmin(1).to(torch.uint8)
    return (codes[::2] << 4 | codes[1::2]).unsqueeze(1), absmax, codes


def test_bnb_nf4_import(k, torch_path):
    n, kk, blocksize = 40, 256, 64
    w = _weight(n, kk, torch.float32, seed=33)
    codebook = torch.tensor(k.NF4_CODEBOOK)
    packed, absmax, codes = _bnb_quantize(w, blocksize, codebook)
    qw = k.from_bnb_nf4(packed, absmax, shape=(n, kk), blocksize=blocksize, dtype=torch.bfloat16)
    want = (codebook[codes.long()].view(-1, blocksize) * absmax[:, None]).view(n, kk)
    assert torch.equal(k.dequantize(qw, torch.float32), want)
    assert k.dequantize(qw).dtype == torch.bfloat16
    # This kernel's own NF4 quantization picks the same codes and block absmax from an fp32 weight.
    ours = k.quantize(w, group_size=blocksize, fmt="nf4")
    assert torch.equal(k.formats.unpack(ours.qweight, (n, kk)).reshape(-1), codes)


def test_bnb_nf4_nested_absmax(k, torch_path):
    n, kk, blocksize, nested_blocksize = 32, 256, 64, 64
    w = _weight(n, kk, torch.float32, seed=34)
    packed, absmax, codes = _bnb_quantize(w, blocksize, torch.tensor(k.NF4_CODEBOOK))
    offset = absmax.mean().item()  # bitsandbytes' double quantization: 8-bit codes of absmax - mean
    centred = (absmax - offset).view(-1, nested_blocksize)
    nested_absmax = centred.abs().amax(1)
    nested_map = torch.linspace(-1, 1, 256)
    absmax_codes = ((centred / nested_absmax[:, None]).reshape(-1, 1) - nested_map).abs().argmin(1).to(torch.uint8)
    qw = k.from_bnb_nf4(packed, absmax_codes, shape=(n, kk), blocksize=blocksize, nested_absmax=nested_absmax,
                        nested_quant_map=nested_map, nested_blocksize=nested_blocksize, offset=offset)
    restored = nested_map[absmax_codes.long()] * nested_absmax.repeat_interleave(nested_blocksize) + offset
    want = torch.tensor(k.NF4_CODEBOOK)[codes.long()].view(-1, blocksize) * restored[:, None]
    assert torch.equal(k.dequantize(qw, torch.float32), want.view(n, kk))


# --- save / load, modules --------------------------------------------------------------------------------

def test_safetensors_round_trip(k, tmp_path):
    _, qweight, qzeros, scales = _gptq_tensors(384, 40, 128, torch.randint(0, 16, (3, 40), generator=_gen(35)), 36)
    weights = {
        "act_order": k.from_gptq(qweight, qzeros, scales, (torch.randperm(384, generator=_gen(37)) // 128).int(),
                                 sym=False, checkpoint_format="gptq_v2"),
        "nf4": k.quantize(_weight(N, 320, torch.bfloat16), group_size=64, fmt="nf4"),
        "per_channel": k.quantize(_weight(N, 200), group_size=-1, zero_point=True),
    }
    k.save_quantized(weights, tmp_path / "w.safetensors")
    loaded = k.load_quantized(tmp_path / "w.safetensors")
    assert set(loaded) == set(weights)
    for name, qw in weights.items():
        again = loaded[name]
        assert (again.shape, again.group_size, again.fmt, again.dtype) == (qw.shape, qw.group_size, qw.fmt, qw.dtype)
        assert again.tensors().keys() == qw.tensors().keys()
        assert all(torch.equal(again.tensors()[f], t) for f, t in qw.tensors().items())
    k.save_quantized(weights["nf4"], tmp_path / "one.safetensors")
    assert isinstance(k.load_quantized(tmp_path / "one.safetensors"), k.QuantizedWeight)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="save_quantized"):
        k.load_quantized(tmp_path / "other.safetensors")


def test_quantize_model_replaces_linears(k, torch_path):
    torch.manual_seed(38)
    model = torch.nn.Sequential()
    model.add_module("up", torch.nn.Linear(96, 160))
    model.add_module("act", torch.nn.SiLU())
    model.add_module("down", torch.nn.Linear(160, 96, bias=False))
    model.add_module("lm_head", torch.nn.Linear(96, 50))
    model = model.half()
    x = torch.randn(5, 96, generator=_gen(39)).half()
    want = model(x).double()
    k.quantize_model(model, group_size=32)
    assert isinstance(model.up, k.W4A16Linear) and isinstance(model.down, k.W4A16Linear)
    assert type(model.lm_head) is torch.nn.Linear
    got = model(x)
    assert got.dtype == torch.float16 and _rel_err(got, want) < 0.15  # 4-bit weights' own error
    hidden = torch.nn.functional.silu(k.matmul(x, model.up.quantized_weight, model.up.bias))
    assert torch.equal(model.down(hidden), k.matmul(hidden, model.down.quantized_weight))
    clone = k.W4A16Linear(model.up.quantized_weight, model.up.bias)
    clone.load_state_dict(model.up.state_dict())
    assert torch.equal(clone(x), model.up(x))


def test_from_linear_and_repr(k, torch_path):
    linear = torch.nn.Linear(128, 24).to(torch.bfloat16)
    layer = k.W4A16Linear.from_linear(linear, group_size=64, zero_point=True)
    assert "zero_point=True" in repr(layer) and layer.zeros is not None
    x = torch.randn(2, 128, generator=_gen(40)).bfloat16()
    assert _rel_err(layer(x), _reference(k, x, layer.quantized_weight, linear.bias)) < TOL[torch.bfloat16]


# --- bad input -------------------------------------------------------------------------------------------

def test_quantize_rejects_bad_input(k):
    w = _weight(8, 256)
    with pytest.raises(TypeError, match="weight"):
        k.quantize(w.int())
    with pytest.raises(ValueError, match="2-D"):
        k.quantize(w[0])
    with pytest.raises(ValueError, match="not divisible"):
        k.quantize(_weight(8, 200), group_size=64)
    with pytest.raises(ValueError, match="group_size"):
        k.quantize(w, group_size=48)
    with pytest.raises(ValueError, match="fmt"):
        k.quantize(w, fmt="int3")
    with pytest.raises(ValueError, match="zero_point"):
        k.quantize(w, fmt="nf4", zero_point=True)
    bad = w.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        k.quantize(bad)


def test_matmul_rejects_bad_input(k):
    qw = k.quantize(_weight(N, 256), group_size=128)
    x = torch.randn(2, 256).half()
    with pytest.raises(TypeError, match="x must be float16 or bfloat16"):
        k.matmul(x.float(), qw)
    with pytest.raises(TypeError, match="x must be float16"):
        k.matmul(x.int(), qw)
    with pytest.raises(ValueError, match=r"\[\.\.\., 256\]"):
        k.matmul(torch.randn(2, 128).half(), qw)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        k.matmul(x, qw.qweight)
    with pytest.raises(ValueError, match="bias must have shape"):
        k.matmul(x, qw, torch.zeros(N + 1).half())
    with pytest.raises(TypeError, match="bias must have x's dtype"):
        k.matmul(x, qw, torch.zeros(N))
    with pytest.raises(ValueError, match="meta"):
        k.matmul(x.to("meta"), qw)


def test_quantized_weight_rejects_inconsistent_tensors(k):
    qw = k.quantize(_weight(N, 256), group_size=128)
    fields = dict(qweight=qw.qweight, scales=qw.scales, zeros=None, codebook=None, perm=None, shape=(N, 256),
                  group_size=128, fmt="int4", dtype=torch.float16)
    with pytest.raises(ValueError, match="qweight must be int32 of shape"):
        k.QuantizedWeight(**{**fields, "shape": (N, 512)})
    with pytest.raises(ValueError, match="scales must be"):
        k.QuantizedWeight(**{**fields, "scales": qw.scales[:1]})
    with pytest.raises(ValueError, match="codebook"):
        k.QuantizedWeight(**{**fields, "fmt": "nf4"})
    with pytest.raises(ValueError, match="perm"):
        k.QuantizedWeight(**{**fields, "perm": torch.arange(10)})


def test_importers_reject_mismatched_tensors(k):
    _, qweight, qzeros, scales = _gptq_tensors(256, 16, 128, torch.full((2, 16), 7), seed=41)
    with pytest.raises(TypeError, match="qweight"):
        k.from_gptq(qweight.float(), qzeros, scales)
    with pytest.raises(ValueError, match="scales must have shape"):
        k.from_gptq(qweight, qzeros, scales[:, :8])
    with pytest.raises(ValueError, match="qzeros must have shape"):
        k.from_gptq(qweight, qzeros[:1], scales)
    with pytest.raises(ValueError, match="checkpoint_format"):
        k.from_gptq(qweight, qzeros, scales, checkpoint_format="exllama")
    with pytest.raises(ValueError, match="g_idx values"):
        k.from_gptq(qweight, qzeros, scales, torch.full((256,), 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="exactly 128"):
        k.from_gptq(qweight, qzeros, scales, torch.zeros(256, dtype=torch.int32))
    with pytest.raises(ValueError, match="groups"):
        k.from_gptq(qweight, qzeros[:1].repeat(3, 1), scales[:1].repeat(3, 1))
    with pytest.raises(ValueError, match="qzeros must have shape"):
        k.from_awq(torch.zeros(256, 2, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), scales)
    packed = torch.zeros(16 * 256 // 2, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="divisible by blocksize"):
        k.from_bnb_nf4(packed, torch.ones(64), shape=(16, 256), blocksize=96)
    with pytest.raises(ValueError, match="must hold"):
        k.from_bnb_nf4(packed[1:], torch.ones(64), shape=(16, 256))
    with pytest.raises(ValueError, match="absmax must have"):
        k.from_bnb_nf4(packed, torch.ones(63), shape=(16, 256))
