"""moe-dispatch with 4-bit experts on CPU: the format against w4a16's, the Triton kernels through the interpreter
and the PyTorch path against float64 references, small shapes.

The references take the dequantized weights exactly (fp32 values of ``(q - zero) * scale`` etc.: exact with 16-bit
scales, within 2^-24 otherwise) in float64, so quantization error is not measured, only the kernels'
arithmetic. On top of the dense kernels' roundings (test_moe_dispatch.py: SiLU*up, weighted expert output,
final sum) the 4-bit paths round each dequantized weight once to the activation dtype (the tl.dot operand;
int4 in groups of >= 128 columns takes exact integers and scales in fp32 instead): one more rounding of 2^-8
(bf16, 2^-7 where the interpreter truncates) or 2^-11 (fp16), random in sign across the K terms of each dot,
so it adds well under one rounding to the relative error of a result. Tolerances (relative to the
reference's norm; max error 4x that against the max): bf16 2.5e-2 as for the dense kernels (three
truncations of 2^-7 relative reach ~2.4e-2 only when all line up), fp16 5e-3 (five roundings of 2^-11 =
2.4e-3, doubled), fp32 1e-5 (fp32 roundings and the tf32x3 dots).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}

# (name, fmt, zero_point, group_size, H, I): H and I are each some matrix's K, so they are multiples of the
# group size; none is a multiple of 128 unless the group needs it, so K padding (masked x) and N padding
# (rows past N, 2I) are both exercised.
FORMATS = [
    ("int4-sym-g32", "int4", False, 32, 160, 32),
    ("int4-zp-g64", "int4", True, 64, 64, 64),
    ("int4-zp-g128", "int4", True, 128, 128, 128),
    ("int4-sym-g256", "int4", False, 256, 256, 256),
    ("nf4-g64", "nf4", False, 64, 192, 64),
    ("int4-min-g32", "int4", "float", 32, 96, 32),
    ("int4-zp-channel", "int4", True, -1, 100, 40),
]
FORMAT_IDS = [f[0] for f in FORMATS]


# The reference helpers of test_moe_dispatch.py (copied: float64, independent of the kernels).


def make_experts(E, H, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w_down = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    return w_gate_up, w_down


def experts_float64(x, w_gate_up, w_down, topk_weights, topk_ids):
    """sum over slots of weight * down(silu(gate(x)) * up(x)), one (token, slot) pair at a time."""
    intermediate = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w_gate_up[e].double() @ x[t].double()
            act = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            out[t] += float(topk_weights[t, j]) * (w_down[e].double() @ act)
    return out


def route_float64(logits, top_k, scoring="softmax", renormalize=True, bias=None, num_groups=None, topk_groups=None,
                  scaling=1.0):
    """Per token: scores, (group filter), top-k by score + bias, weights from the plain scores."""
    weights, ids = [], []
    for row in logits.double():
        scores = row.sigmoid() if scoring == "sigmoid" else row.softmax(0)
        choice = scores + (bias.double() if bias is not None else 0.0)
        allowed = list(range(len(row)))
        if num_groups:
            size = len(row) // num_groups
            group_score = [sum(sorted(choice[g * size:(g + 1) * size].tolist())[-2:]) for g in range(num_groups)]
            kept = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
            allowed = [e for e in allowed if e // size in kept]
        chosen = sorted(allowed, key=lambda e: -float(choice[e]))[:top_k]
        w = scores[chosen]
        if renormalize:
            w = w / (w.sum() + (1e-20 if scoring == "sigmoid" else 0.0))
        weights.append(w * scaling)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids)


def routing(kind, T, E, k, seed=0):
    """balanced: random top-k; skewed: every token on experts 1..k (the rest empty); empty: only even experts."""
    g = torch.Generator().manual_seed(seed)
    if kind == "balanced":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    elif kind == "skewed":
        ids = torch.arange(1, k + 1).repeat(T, 1)
    else:
        ids = torch.stack([torch.randperm(E // 2, generator=g)[:k] * 2 for _ in range(T)])
    weights = torch.rand(T, k, generator=g) + 0.1
    return weights / weights.sum(1, keepdim=True), ids.to(torch.int32)


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("moe-dispatch")


@pytest.fixture(scope="module")
def w4a16(load_kernel):
    return load_kernel("w4a16")


def quantized_experts(k, E, H, I, fmt, zero_point, group_size, dtype, seed=0):
    w_gate_up, w_down = make_experts(E, H, I, dtype, seed)
    return k.quantize_experts(w_gate_up, w_down, group_size=group_size, fmt=fmt, zero_point=zero_point)


def dequantized64(k, qe):
    return k.dequantize(qe, torch.float32).double()


def assert_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output (unwritten or poisoned elements)"
    diff = out.double() - ref
    tol = TOL[dtype]
    assert diff.norm() <= tol * ref.norm(), f"relative error {(diff.norm() / ref.norm()).item():.2e} > {tol}"
    assert diff.abs().max() <= 4 * tol * ref.abs().max()


# ----------------------------------------------------------------------------------------------------
# The format: the same bits as w4a16
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,fmt,zero_point,group_size,H,I", FORMATS, ids=FORMAT_IDS)
def test_format_matches_w4a16(k, w4a16, monkeypatch, name, fmt, zero_point, group_size, H, I):
    """Each expert quantized by w4a16.quantize gives the same packed words, scales, zero points, minima,
    codebook and dequantized values as moe-dispatch's stacked copy of the format (w4a16.dequantize on its
    PyTorch path)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    E = 3
    w_gate_up, w_down = make_experts(E, H, I, torch.bfloat16, seed=3)
    q_gate_up, q_down = k.quantize_experts(w_gate_up, w_down, group_size=group_size, fmt=fmt, zero_point=zero_point)
    for dense, qe in ((w_gate_up, q_gate_up), (w_down, q_down)):
        assert qe.shape == tuple(dense.shape[1:]) and qe.num_experts == E and qe.fmt == fmt
        ours = k.dequantize(qe, torch.float32)
        for e in range(E):
            ref = w4a16.quantize(dense[e], group_size=group_size, fmt=fmt, zero_point=zero_point)
            assert torch.equal(qe.qweight[e], ref.qweight)
            assert torch.equal(qe.scales[e], ref.scales)
            for field in ("zeros", "mins"):
                mine, theirs = getattr(qe, field), getattr(ref, field)
                assert (mine is None) == (theirs is None), field
                if theirs is not None:
                    assert torch.equal(mine[e], theirs), field
            assert (qe.codebook is None) == (ref.codebook is None)
            if ref.codebook is not None:
                assert torch.equal(qe.codebook, ref.codebook)
            assert torch.equal(ours[e], w4a16.dequantize(ref, torch.float32))
        assert torch.equal(k.dequantize(qe), ours.to(torch.bfloat16))


@pytest.mark.parametrize("module", ["mma_gemv.py", "warp_specialize.py", "wgmma_chunks.py"])
def test_gluon_modules_are_w4a16s(k, w4a16, module):
    """What moe-dispatch's Gluon kernels share with w4a16's (the PTX edit the grouped kernel compiles under, its
    chains' int4 operand, the tensor-core GEMV's K loop) is w4a16's module byte for byte, as built: each standalone
    package carries it, and one may not drift from the other."""
    ours = Path(k.ops.triton_kernels.__file__).with_name(module)
    theirs = Path(w4a16.triton_kernels.__file__).with_name(module)
    assert ours.read_bytes() == theirs.read_bytes()


def test_quant_config_is_w4a16s(k, w4a16):
    """The quantization_config checks both checkpoint loaders share are the same module in both packages."""
    ours = Path(k.__file__).with_name("quant_config.py")
    theirs = Path(w4a16.__file__).with_name("quant_config.py")
    assert ours.read_bytes() == theirs.read_bytes()


def test_pack_unpack_roundtrip(k):
    q = k.quantized
    codes = torch.randint(0, 16, (2, 70, 200), dtype=torch.uint8)
    packed = q.pack(codes)
    assert packed.shape == (2, 128, 256 // 8) and packed.dtype == torch.int32
    assert torch.equal(q.unpack(packed, (70, 200)), codes)


def test_pack_k_words_matches_pack(k):
    """GPTQ-style words ([E, K / 8, N], 8 consecutive K-codes each) re-laid as bytes equal `pack` of their codes,
    padding included."""
    q = k.quantized
    codes = torch.randint(0, 16, (3, 200, 136), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    words = torch.zeros(3, 136 // 8, 200, dtype=torch.int64)
    for p in range(8):
        words |= codes[..., p::8].transpose(-1, -2).long() << (4 * p)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(q.pack_k_words(words, (200, 136)), q.pack(codes))


def test_nbytes_and_shard(k):
    q_gate_up, q_down = quantized_experts(k, 4, 160, 96, "int4", True, 32, torch.bfloat16)
    # per expert: Np * Kp / 2 bytes of codes + G * Np scales (2 bytes) + G * Np zero points (1 byte)
    assert q_gate_up.expert_nbytes() == 256 * 256 // 2 + 8 * 256 * 3
    assert q_down.nbytes() == 4 * (256 * 128 // 2 + 4 * 256 * 3)
    shard = q_gate_up.experts(slice(2, 4))
    assert shard.num_experts == 2 and torch.equal(shard.qweight, q_gate_up.qweight[2:])


# ----------------------------------------------------------------------------------------------------
# fused_experts with 4-bit experts
# ----------------------------------------------------------------------------------------------------


def quantized_reference(k, x, q_gate_up, q_down, weights, ids):
    return experts_float64(x, dequantized64(k, q_gate_up), dequantized64(k, q_down), weights, ids)


# T <= 4: the GEMV kernels (the packed-fp16 ones for int4 in groups of >= 128 or per channel with 16-bit
# activations up to T = 16 while pairs are at most 2.5 per expert); T <= 16: the decode kernels; larger T: sort +
# grouped kernels (all with the dequantization in the K loop)
CASES = [
    # (format, T, E, top_k, routing kind, dtype)
    ("int4-zp-g64", 2, 6, 3, "empty", torch.float16),
    ("int4-zp-channel", 4, 4, 2, "balanced", torch.bfloat16),
    ("int4-sym-g32", 4, 4, 2, "skewed", torch.bfloat16),
    ("int4-sym-g256", 12, 3, 2, "balanced", torch.float16),
    ("int4-sym-g32", 1, 4, 2, "balanced", torch.bfloat16),
    ("int4-sym-g32", 20, 4, 2, "skewed", torch.bfloat16),
    ("int4-zp-g64", 5, 6, 3, "empty", torch.float16),
    ("int4-zp-g128", 3, 4, 2, "skewed", torch.float32),
    ("int4-zp-g128", 18, 4, 2, "empty", torch.bfloat16),
    ("int4-sym-g256", 1, 3, 2, "balanced", torch.bfloat16),
    ("nf4-g64", 4, 4, 2, "balanced", torch.bfloat16),
    ("nf4-g64", 24, 6, 2, "empty", torch.float16),
    ("int4-min-g32", 1, 4, 2, "balanced", torch.bfloat16),
    ("int4-min-g32", 17, 4, 3, "skewed", torch.float32),
    ("int4-zp-channel", 21, 4, 2, "empty", torch.float16),
]


def test_mma_gate_up_refused_where_it_cannot_run(k):
    """A config asking for the tensor-core gate/up GEMV ("MMA") where it cannot run (here: the interpreter, CPU
    tensors) is a ValueError naming the key, not the packed GEMV's answer under its name."""
    q_gate_up, q_down = quantized_experts(k, 4, 256, 128, "int4", False, 128, torch.bfloat16)
    x = torch.randn(1, 256).bfloat16()
    weights, ids = routing("balanced", 1, 4, 2)
    plan = {"BLOCK_N": 16, "BLOCK_K": 128, "TILES": 2, "num_warps": 2, "num_stages": 1}
    with pytest.raises(ValueError, match="MMA"):
        k.ops.triton_kernels.experts(x, q_gate_up, q_down, weights, ids, torch.empty_like(x),
                                     config={"GEMV": True, "gate_up": {**plan, "MMA": True}, "down": plan})
    with pytest.raises(ValueError, match="MMA"):
        k.ops.triton_kernels.experts(x, q_gate_up, q_down, weights, ids, torch.empty_like(x),
                                     config={"GEMV": True, "gate_up": {**plan, "MMA": "yes"}, "down": plan})


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[1]}-{c[4]}-{str(c[5])[6:]}" for c in CASES])
def test_fused_experts_4bit(k, path, case):
    name, T, E, top_k, kind, dtype = case
    _, fmt, zero_point, group_size, H, I = FORMATS[FORMAT_IDS.index(name)]
    q_gate_up, q_down = quantized_experts(k, E, H, I, fmt, zero_point, group_size, dtype)
    x = torch.randn(T, H).to(dtype)
    weights, ids = routing(kind, T, E, top_k)
    out = k.fused_experts(x, q_gate_up, q_down, weights, ids)
    assert_close(out, quantized_reference(k, x, q_gate_up, q_down, weights, ids), dtype)


@pytest.mark.parametrize("T", [3, 20])
def test_every_output_element_written(k, monkeypatch, T):
    """The launcher writes into a NaN-poisoned output; int64 ids, duplicate slots, bf16 routing weights, and
    ids outside [0, E) that select nothing."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    E, H, I = 4, 160, 32
    q_gate_up, q_down = quantized_experts(k, E, H, I, "int4", True, 32, torch.float16)
    x = torch.randn(T, H, dtype=torch.float16)
    ids = torch.randint(0, E, (T, 3), dtype=torch.int64)
    ids[0] = 2  # the same expert in every slot of token 0
    ids[1, 1] = E  # a sentinel: selects nothing
    ids[2, 0] = -1
    weights = torch.rand(T, 3).to(torch.bfloat16)
    out = torch.full((T, H), float("nan"), dtype=torch.float16)
    k.ops.triton_kernels.experts(x, q_gate_up, q_down, weights, ids, out)
    kept = weights.float() * ((ids >= 0) & (ids < E))
    assert_close(out, quantized_reference(k, x, q_gate_up, q_down, kept, ids.clamp(0, E - 1)), torch.float16)


# The packed-fp16 GEMVs (int4 in groups of >= 128 or per channel, 16-bit activations) under every launch plan
# they take: pointer loads or TMA boxes, x broadcast over the rows or in the weight tile's shape, 1 or 3 stages,
# split-K of the down GEMV (fp32 partials the combine adds), loop steps past the last tile, K past a tile's end
# (per channel: H = 320, I = 192).
PACKED_PLANS = {
    "plain": {"BLOCK_N": 8, "TILES": 2, "num_warps": 4, "num_stages": 1},
    "bcast-ring": {"BLOCK_N": 16, "TILES": 2, "num_warps": 2, "num_stages": 3, "X_BCAST": True},
    "tma-split": {"BLOCK_N": 16, "TILES": 1, "num_warps": 2, "num_stages": 3, "X_BCAST": True, "TMA": True,
                  "SPLIT_K": 2},
    "tma-wide": {"BLOCK_N": 32, "TILES": 4, "num_warps": 4, "num_stages": 2, "TMA": True, "SPLIT_K": 3},
}


@pytest.mark.parametrize("plan,fmt_name,dtype", [
    ("plain", "int4-sym-g128", torch.bfloat16), ("bcast-ring", "int4-zp-g128", torch.float16),
    ("tma-split", "int4-zp-channel", torch.bfloat16), ("tma-wide", "int4-sym-g128", torch.bfloat16),
    ("tma-split", "int4-zp-g128", torch.float16), ("bcast-ring", "int4-zp-channel", torch.bfloat16)])
def test_packed_gemv_plans(k, monkeypatch, plan, fmt_name, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    zero_point, group_size = {"int4-sym-g128": (False, 128), "int4-zp-g128": (True, 128),
                              "int4-zp-channel": (True, -1)}[fmt_name]
    E, H, I, T, top_k = 4, 320 if group_size == -1 else 384, 192 if group_size == -1 else 128, 3, 2
    q_gate_up, q_down = quantized_experts(k, E, H, I, "int4", zero_point, group_size, dtype)
    assert k.ops.triton_kernels.packed_gemv(q_down, dtype) and not k.ops.triton_kernels.packed_gemv(q_down,
                                                                                                     torch.float32)
    x = (torch.randn(T, H) * 30).to(dtype)  # |x| past fp16's 2^11 scaled range: the per-tile scaling must hold
    weights, ids = routing("balanced", T, E, top_k)
    ids[2, 1] = E  # selects nothing
    out = torch.full((T, H), float("nan"), dtype=dtype)
    k.ops.triton_kernels.experts(x, q_gate_up, q_down, weights, ids, out,
                                 config={"GEMV": True, "gate_up": PACKED_PLANS[plan], "down": PACKED_PLANS[plan]})
    kept = weights * (ids < E)
    assert_close(out, quantized_reference(k, x, q_gate_up, q_down, kept, ids.clamp(max=E - 1)), dtype)


# E64 / E65's plan keys on the packed GEMVs (docs/design/moe-dispatch.md): early loads and launch order (E64), the
# combine folded into the down GEMV (E65). The interpreter runs programs one after another, so here they can only
# show the arithmetic unchanged; the GPU test checks the ordering.
OVERLAP_VARIANTS = {
    "trigger-start": ({"PDL_TRIGGER": "start"}, {}),
    "preload": ({}, {"PRELOAD_WORDS": True}),
    "fold": ({}, {"FOLD_COMBINE": True}),
    "start-preload-fold": ({"PDL_TRIGGER": "start"}, {"PRELOAD_WORDS": True, "FOLD_COMBINE": True}),
}


@pytest.mark.parametrize("variant", sorted(OVERLAP_VARIANTS))
@pytest.mark.parametrize("fmt_name,dtype", [("int4-sym-g128", torch.bfloat16), ("int4-zp-g128", torch.float16),
                                            ("int4-zp-channel", torch.bfloat16)])
def test_decode_overlap_bit_equal(k, monkeypatch, variant, fmt_name, dtype):
    """Each variant bit-equal to the plan without its keys, with a pair that selects nothing and a token whose pairs
    all select nothing (the fold must write its zeros), into NaN-poisoned outputs; and within TOL of float64."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    zero_point, group_size = {"int4-sym-g128": (False, 128), "int4-zp-g128": (True, 128),
                              "int4-zp-channel": (True, -1)}[fmt_name]
    E, H, I, T, top_k = 4, 320 if group_size == -1 else 384, 192 if group_size == -1 else 256, 3, 2
    q_gate_up, q_down = quantized_experts(k, E, H, I, "int4", zero_point, group_size, dtype)
    x = (torch.randn(T, H) * 30).to(dtype)
    weights, ids = routing("balanced", T, E, top_k)
    ids[0, 1] = E  # selects nothing
    ids[2] = -1  # a token whose pairs select nothing
    plan = PACKED_PLANS["bcast-ring"]
    up_keys, down_keys = OVERLAP_VARIANTS[variant]
    outs = []
    for up, down in (({}, {}), (up_keys, down_keys)):
        out = torch.full((T, H), float("nan"), dtype=dtype)
        k.ops.triton_kernels.experts(x, q_gate_up, q_down, weights, ids, out,
                                     config={"GEMV": True, "gate_up": {**plan, **up}, "down": {**plan, **down}})
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert not outs[1][2].any()
    kept = weights * ((ids >= 0) & (ids < E))
    assert_close(outs[1], quantized_reference(k, x, q_gate_up, q_down, kept, ids.clamp(0, E - 1)), dtype)


@pytest.mark.parametrize("up,down,match", [
    ({"PDL_TRIGGER": "middle"}, {}, "PDL_TRIGGER"),
    ({}, {"PRELOAD_WORDS": "lines"}, "PRELOAD_WORDS"),
    ({}, {"FOLD_COMBINE": "yes"}, "FOLD_COMBINE"),
    ({}, {"FOLD_COMBINE": True, "TILES": 1, "SPLIT_K": 2}, "FOLD_COMBINE needs one split"),
    ({}, {"PRELOAD_WORDS": True, "TILES": 1}, "one loop step"),
])
def test_decode_overlap_keys_checked(k, monkeypatch, up, down, match):
    """A malformed E64 / E65 key is refused by name, as is the fold of a down GEMV split over K."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    E, H, I, T, top_k = 4, 384, 256, 2, 2
    q_gate_up, q_down = quantized_experts(k, E, H, I, "int4", False, 128, torch.bfloat16)
    weights, ids = routing("balanced", T, E, top_k)
    plan = PACKED_PLANS["bcast-ring"]
    with pytest.raises(ValueError, match=match):
        k.ops.triton_kernels.experts(torch.randn(T, H).bfloat16(), q_gate_up, q_down, weights, ids,
                                     torch.empty(T, H, dtype=torch.bfloat16),
                                     config={"GEMV": True, "gate_up": {**plan, **up}, "down": {**plan, **down}})


def test_decode_overlap_keys_need_packed_gemvs(k, monkeypatch):
    """The keys belong to the packed-fp16 GEMVs: with a format the fp32 GEMVs run (NF4) they are refused."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    E, H, I, T, top_k = 4, 192, 64, 2, 2
    q_gate_up, q_down = quantized_experts(k, E, H, I, "nf4", False, 64, torch.bfloat16)
    weights, ids = routing("balanced", T, E, top_k)
    plan = PACKED_PLANS["bcast-ring"]
    with pytest.raises(ValueError, match="packed-fp16 GEMVs only"):
        k.ops.triton_kernels.experts(torch.randn(T, H).bfloat16(), q_gate_up, q_down, weights, ids,
                                     torch.empty(T, H, dtype=torch.bfloat16),
                                     config={"GEMV": True, "gate_up": plan, "down": {**plan, "FOLD_COMBINE": True}})


DOT_OPERANDS = {  # the tl.dot kernels' operand options for int4 in whole-tile groups: (PACKED, SWAP_AB)
    "packed-swap": (True, True), "packed": (True, False), "fp32-planes-swap": (False, True),
    "fp32-planes": (False, False),
}


@pytest.mark.parametrize("operands", sorted(DOT_OPERANDS))
@pytest.mark.parametrize("fmt_name,T,dtype", [("int4-zp-g128", 18, torch.bfloat16), ("int4-sym-g256", 9, torch.float16),
                                              ("int4-zp-channel", 21, torch.float16)])
def test_dot_operand_plans(k, monkeypatch, operands, fmt_name, T, dtype):
    """The decode (T <= 16) and grouped kernels with each operand option, into a NaN-poisoned output; H and I
    not multiples of 128 where the group allows (masked K, rows past N)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _, fmt, zero_point, group_size, H, I = FORMATS[FORMAT_IDS.index(fmt_name)]
    E, top_k = 4, 2
    q_gate_up, q_down = quantized_experts(k, E, H, I, fmt, zero_point, group_size, dtype)
    x = torch.randn(T, H).to(dtype)
    weights, ids = routing("skewed" if T > 16 else "balanced", T, E, top_k)
    packed, swap = DOT_OPERANDS[operands]
    tk = k.ops.triton_kernels
    config = tk.default_config(T, E, H, I, top_k, torch.device("cpu"), quantized=True)
    config = {key: {**v, "PACKED": packed, "SWAP_AB": swap} if isinstance(v, dict) else v for key, v in config.items()}
    assert "GEMV" not in config
    out = torch.full((T, H), float("nan"), dtype=dtype)
    tk.experts(x, q_gate_up, q_down, weights, ids, out, config=config)
    assert_close(out, quantized_reference(k, x, q_gate_up, q_down, weights, ids), dtype)


@pytest.mark.parametrize("fmt_name,dtype,chunk_cols", [
    ("int4-zp-g64", torch.bfloat16, 16), ("nf4-g64", torch.float16, 48), ("int4-min-g32", torch.float32, 32),
    ("int4-sym-g256", torch.bfloat16, 1 << 20), ("int4-zp-channel", torch.float16, 16)])
def test_dequantize_first(k, monkeypatch, fmt_name, dtype, chunk_cols):
    """At many pairs per expert the experts are dequantized (chunks of columns of every expert into one reused
    buffer) and run by the bf16 grouped kernels: every format, one chunk to many, chunks that end inside a block
    of columns, empty experts, into a NaN-poisoned output."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tk = k.ops.triton_kernels
    _, fmt, zero_point, group_size, H, I = FORMATS[FORMAT_IDS.index(fmt_name)]
    E, top_k, T = 6, 2, 20
    q_gate_up, q_down = quantized_experts(k, E, H, I, fmt, zero_point, group_size, dtype)
    # gate/up chunks of chunk_cols columns (gate and up rows of every expert); the down chunks take as many bytes
    monkeypatch.setattr(tk.launch, "DEQUANT_CHUNK_BYTES", chunk_cols * E * 2 * H * dtype.itemsize)
    monkeypatch.setattr(tk.launch, "DEQUANT_MIN_PAIRS", 2)  # 40 pairs on 6 experts: past it
    monkeypatch.setattr(tk.launch, "DEQUANT_BLOCK_N", 8)  # several dequantize programs per chunk
    chunks = []
    dequantized = tk.launch._dequantized_columns

    def counted(parts, dtype, side=None):
        spans = []
        for index, col_lo, width, out in dequantized(parts, dtype, side):
            _, cols, block_n, _ = parts[index]
            assert width % block_n == 0 or col_lo + width == cols
            spans.append((index, col_lo, width))
            yield index, col_lo, width, out
        assert [index for index, _, _ in spans] == sorted(index for index, _, _ in spans)  # gate/up, then down
        for index, (_, cols, _, _) in enumerate(parts):
            mine = [(lo, width) for i, lo, width in spans if i == index]
            assert [lo for lo, _ in mine] == list(range(0, cols, mine[0][1]))  # the columns, each once, in order
            chunks.append(len(mine))

    monkeypatch.setattr(tk.launch, "_dequantized_columns", counted)
    x = torch.randn(T, H).to(dtype)
    weights, ids = routing("empty", T, E, top_k)
    out = torch.full((T, H), float("nan"), dtype=dtype)
    plan = {"BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 2}
    # one chunk: the launcher's own choice past DEQUANT_MIN_PAIRS; else 16-column blocks, so chunk_cols (a multiple
    # of 16) is the chunk's width
    config = None if chunk_cols >= 1 << 20 else {"DEQUANT": True, "BLOCK_M": 16, "gate_up": plan, "down": plan}
    tk.experts(x, q_gate_up, q_down, weights, ids, out, config=config)
    assert len(chunks) == 2 and chunks[0] == -(-I // chunk_cols)
    assert_close(out, quantized_reference(k, x, q_gate_up, q_down, weights, ids), dtype)


def test_dequantize_kernel_matches_dequantize(k, monkeypatch):
    """The dequantize kernel's experts are `dequantize`'s, bit for bit (one fp32 product, one rounding), in one
    chunk and in chunks of 8 columns (gate / up: the chunk's gate rows, then its up rows)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launch = k.ops.triton_kernels.launch
    for name in ("int4-zp-g64", "nf4-g64", "int4-zp-channel"):
        _, fmt, zero_point, group_size, H, I = FORMATS[FORMAT_IDS.index(name)]
        q_gate_up, q_down = quantized_experts(k, 3, H, I, fmt, zero_point, group_size, torch.float16)
        gate_up, down = (k.dequantize(q, torch.float16) for q in (q_gate_up, q_down))
        monkeypatch.setattr(launch, "DEQUANT_CHUNK_BYTES", 1 << 30)
        ((_, lo, width, gu),) = list(launch._dequantized_columns([(q_gate_up, I, 8, True)], torch.float16))
        assert (lo, width) == (0, I) and torch.equal(gu, gate_up), name
        ((_, lo, width, dn),) = list(launch._dequantized_columns([(q_down, H, 8, False)], torch.float16))
        assert (lo, width) == (0, H) and torch.equal(dn, down), name
        monkeypatch.setattr(launch, "DEQUANT_CHUNK_BYTES", 8 * 3 * 2 * H * 2)  # 8 gate/up columns
        spans = []
        for _, lo, width, gu in launch._dequantized_columns([(q_gate_up, I, 8, True)], torch.float16):
            assert torch.equal(gu[:, :width], gate_up[:, lo:lo + width]), name
            assert torch.equal(gu[:, width:], gate_up[:, I + lo:I + lo + width]), name
            spans.append((lo, width))
        assert spans == [(lo, min(8, I - lo)) for lo in range(0, I, 8)], name


def test_gather_rows_kernel(k, monkeypatch):
    """The Gluon path's activations in sorted order: a used block's rows are its pairs' token rows, zero at
    padding; an unused block's rows are left as they were (no kernel reads them). H = 100: a partial column block.
    And each placed pair's sorted row, for the combine."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launch = k.ops.triton_kernels.launch
    T, H, top_k, block_m = 7, 100, 2, 16
    num_pairs = T * top_k
    x = torch.randn(T, H, dtype=torch.float16)
    pairs = torch.randperm(num_pairs, dtype=torch.int32)
    sorted_ids = torch.full((3 * block_m,), num_pairs, dtype=torch.int32)
    sorted_ids[:9], sorted_ids[2 * block_m:2 * block_m + 5] = pairs[:9], pairs[9:]
    sorted_ids[block_m:2 * block_m] = 10**6  # an unused block's ids are never read
    block_expert = torch.tensor([0, -1, 3], dtype=torch.int32)
    out = torch.full((3 * block_m, H), float("nan"), dtype=torch.float16)
    pair_rows = torch.full((num_pairs,), -1, dtype=torch.int32)
    launch._gather_rows_kernel[(3, 2)](x, out, pair_rows, sorted_ids, block_expert, num_pairs, H, x.stride(0),
                                       out.stride(0), TOP_K=top_k, BLOCK_M=block_m, BLOCK_H=64)
    assert torch.equal(sorted_ids[pair_rows.long()], torch.arange(num_pairs, dtype=torch.int32))
    for row, pair in enumerate(sorted_ids.tolist()):
        if block_m <= row < 2 * block_m:
            assert out[row].isnan().all(), row
        elif pair < num_pairs:
            assert torch.equal(out[row], x[pair // top_k]), row
        else:
            assert torch.equal(out[row], torch.zeros(H, dtype=torch.float16)), row


def test_wgmma_plan_elsewhere_runs_the_default_path(k, monkeypatch):
    """A config naming the Gluon grouped kernel (WGMMA) where it does not apply (here: no GPU; likewise NF4 or
    another Triton) runs what `experts` runs without a config, with the same result."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tk = k.ops.triton_kernels
    E, H, I, T, top_k = 4, 128, 128, 40, 2
    q_gate_up, q_down = quantized_experts(k, E, H, I, "int4", True, 128, torch.bfloat16)
    x = torch.randn(T, H).to(torch.bfloat16)
    assert not tk.launch.grouped_wgmma_supported(x, q_gate_up, q_down)
    weights, ids = routing("balanced", T, E, top_k)
    default = tk.experts(x, q_gate_up, q_down, weights, ids, torch.full((T, H), float("nan"), dtype=x.dtype))
    planned = tk.experts(x, q_gate_up, q_down, weights, ids, torch.full((T, H), float("nan"), dtype=x.dtype),
                         config=tk.launch.WGMMA_PLAN)
    assert torch.equal(planned, default)


def test_wgmma_default_from_its_pair_count(k, monkeypatch):
    """Where the Gluon grouped kernel applies, `experts` without a config runs it (WGMMA_PLAN) from WGMMA_MIN_PAIRS
    (token, slot) pairs per expert, and the Triton-language kernels below; the kernel itself is stubbed here (no
    GPU), so only the choice is checked."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launch = k.ops.triton_kernels.launch
    calls = []

    def stub(x, w_gate_up, w_down, topk_weights, sorted_ids, block_expert, inter, top_k, block_m, plan):
        calls.append((block_m, plan))
        return (torch.zeros(sorted_ids.shape[0], x.shape[1], dtype=x.dtype),
                torch.zeros(topk_weights.numel(), dtype=torch.int32))

    monkeypatch.setattr(launch, "grouped_wgmma_supported", lambda *args: True)
    monkeypatch.setattr(launch, "_grouped_wgmma", stub)
    E, H, I, top_k = 2, 128, 128, 2
    q_gate_up, q_down = quantized_experts(k, E, H, I, "int4", False, 128, torch.bfloat16)
    for T, expected in ((launch.WGMMA_MIN_PAIRS - 1, 0), (launch.WGMMA_MIN_PAIRS, 1)):
        calls.clear()
        x = torch.randn(T, H).to(torch.bfloat16)
        weights, ids = routing("balanced", T, E, top_k)  # T pairs per expert: each token picks both experts
        launch.experts(x, q_gate_up, q_down, weights, ids, torch.empty(T, H, dtype=x.dtype))
        assert calls == [(launch.WGMMA_PLAN["BLOCK_M"], launch.WGMMA_PLAN["WGMMA"])] * expected, T


def test_wgmma_min_pairs_halves_on_long_k(k):
    """The Gluon grouped kernel's default threshold halves where both GEMMs' K are long: DeepSeek-V3 (H 7168, I 2048)
    and Mixtral-8x7B (4096, 14336) from 128 pairs per expert, Qwen3-30B-A3B (2048, 768) from 256."""
    launch = k.ops.triton_kernels.launch
    full = launch.WGMMA_MIN_PAIRS
    assert [launch.wgmma_min_pairs(h, i) for h, i in ((7168, 2048), (4096, 14336), (2048, 768), (1920, 4096))] == [
        full // 2, full // 2, full, full]


def test_packed_gemv_cut(k):
    """The packed GEMVs take T <= 16 while (token, slot) pairs are at most 2.5 per expert (each pair streams its
    expert); past that the tl.dot decode kernels, which stream each picked expert once."""
    tk, cpu = k.ops.triton_kernels, torch.device("cpu")
    mixtral, deepseek = (8, 4096, 14336, 2), (256, 7168, 2048, 8)
    assert tk.default_config(8, *mixtral[:3], mixtral[3], cpu, quantized=True, packed=True)["GEMV"]
    assert "GEMV" not in tk.default_config(16, *mixtral[:3], mixtral[3], cpu, quantized=True, packed=True)
    assert tk.default_config(16, *deepseek[:3], deepseek[3], cpu, quantized=True, packed=True)["GEMV"]
    assert "GEMV" not in tk.default_config(17, *deepseek[:3], deepseek[3], cpu, quantized=True, packed=True)
    assert "GEMV" not in tk.default_config(8, *deepseek[:3], deepseek[3], cpu, quantized=True)  # fp32 GEMV: T <= 4


def test_small_experts_overlap_by_default(k, monkeypatch):
    """E64 / E65 / E68's plan is the packed GEMVs' default only where the down GEMV is one 8-tile loop step (I <=
    1024: Qwen3-30B-A3B's 768), the case runs 157-162 measured it faster on: the keys, the fold only up to
    FOLD_MAX_TOKENS tokens, one-warp down programs of 8 rows where 16-row ones would be under 8 per SM. Mixtral's
    and DeepSeek-V3's plans stay as they were."""
    tk, cpu = k.ops.triton_kernels, torch.device("cpu")
    monkeypatch.setattr(tk.configs, "_sm_count", lambda device: 132)
    fold_max = tk.configs.FOLD_MAX_TOKENS
    for intermediate in (768, 1024, 1025, 2048, 14336):
        for tokens in (1, 2, fold_max, fold_max + 1, 16):
            config = tk.default_config(tokens, 128, 2048, intermediate, 8, cpu, quantized=True, packed=True)
            up, down = config["gate_up"], config["down"]
            keys = ({key for key in up if key == "PDL_TRIGGER"}
                    | {key for key in down if key in ("PRELOAD_WORDS", "FOLD_COMBINE")})
            if intermediate > 1024:
                assert keys == set() and down == up, (intermediate, tokens)
                continue
            assert keys == {"PDL_TRIGGER", "PRELOAD_WORDS"} | ({"FOLD_COMBINE"} if tokens <= fold_max else set())
            # 8 pairs x 128 row blocks of 16 = 1024 programs < 8 x 132 at one token
            assert (down["BLOCK_N"], down["num_warps"]) == (8 if tokens == 1 else 16, 1), tokens


def test_sentinel_ids_with_allow_sentinel(k, path):
    """The op behind experts_forward on an expert-parallel shard: id E selects nothing."""
    E, H, I, T = 4, 96, 32, 5
    q_gate_up, q_down = quantized_experts(k, E, H, I, "int4", "float", 32, torch.bfloat16)
    x = torch.randn(T, H).to(torch.bfloat16)
    weights, ids = routing("balanced", T, E, 2)
    ids[::2, 1] = E
    out = k.ops.fused_experts_4bit(x, *q_gate_up.flat(), *q_down.flat(), I, weights, ids, "silu", True)
    kept = weights * (ids < E)
    assert_close(out, quantized_reference(k, x, q_gate_up, q_down, kept, ids.clamp(max=E - 1)), torch.bfloat16)


def test_paths_agree_and_deterministic(k, monkeypatch):
    """Triton (interpreter) and PyTorch paths round at the same places; the Triton path repeats exactly."""
    q_gate_up, q_down = quantized_experts(k, 4, 192, 64, "nf4", False, 64, torch.float32)
    x = torch.randn(18, 192)
    weights, ids = routing("balanced", 18, 4, 2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    first = k.fused_experts(x, q_gate_up, q_down, weights, ids)
    assert torch.equal(first, k.fused_experts(x, q_gate_up, q_down, weights, ids))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.testing.assert_close(k.fused_experts(x, q_gate_up, q_down, weights, ids), first, rtol=1e-5, atol=1e-6)


def test_zero_tokens(k, path):
    q_gate_up, q_down = quantized_experts(k, 4, 96, 32, "int4", False, 32, torch.bfloat16)
    x = torch.empty(0, 96, dtype=torch.bfloat16)
    weights, ids = k.route(torch.empty(0, 4), 2)
    assert k.fused_experts(x, q_gate_up, q_down, weights, ids).shape == (0, 96)
    assert k.moe_forward(x, torch.randn(4, 96), q_gate_up, q_down, 2).shape == (0, 96)


# ----------------------------------------------------------------------------------------------------
# moe_forward with 4-bit experts
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [2, 20])
@pytest.mark.parametrize("mode", ["mixtral", "deepseek-shared"])
def test_moe_forward_4bit(k, path, T, mode):
    """Router fp32, experts int4 g32 bf16; DeepSeek-style routing with a dense shared expert added after."""
    E, H, I, top_k, dtype = 8, 96, 32, 2, torch.bfloat16
    x = torch.randn(T, H).to(dtype)
    router_weight = torch.randn(E, H) / H**0.5
    q_gate_up, q_down = quantized_experts(k, E, H, I, "int4", False, 32, dtype)
    spec, shared = {}, None
    if mode == "deepseek-shared":
        spec = dict(scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2)
        shared = make_experts(1, H, 32, dtype, seed=1)
    out = k.moe_forward(x, router_weight, q_gate_up, q_down, top_k, **spec,
                        shared_gate_up=shared[0][0] if shared else None, shared_down=shared[1][0] if shared else None)
    logits = F.linear(x.float(), router_weight)
    weights, ids = route_float64(logits, top_k, **spec)
    ref = quantized_reference(k, x, q_gate_up, q_down, weights, ids)
    if shared:
        ref += experts_float64(x, shared[0], shared[1], torch.ones(T, 1), torch.zeros(T, 1, dtype=torch.int64))
    assert_close(out, ref, dtype)


# ----------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------


def _bad_calls(k):
    E, H, I, T = 4, 96, 32, 3
    x = torch.randn(T, H, dtype=torch.bfloat16)
    q_gate_up, q_down = quantized_experts(k, E, H, I, "int4", True, 32, torch.bfloat16)
    dense_gate_up, dense_down = make_experts(E, H, I, torch.bfloat16)
    other_gate_up, other_down = quantized_experts(k, E, 128, I, "int4", True, 32, torch.bfloat16)
    weights, ids = routing("balanced", T, E, 2)
    fe = "fused_experts"
    import dataclasses

    return [
        (fe, (x, q_gate_up, dense_down, weights, ids), TypeError, "w_down must be a QuantizedExperts"),
        (fe, (x, dense_gate_up, q_down, weights, ids), TypeError, "w_gate_up must be a QuantizedExperts"),
        (fe, (x, other_gate_up, q_down, weights, ids), ValueError, "w_gate_up"),
        (fe, (x, q_gate_up, other_down, weights, ids), ValueError, "w_down"),
        (fe, (x, q_gate_up, q_down.experts(slice(0, 3)), weights, ids), ValueError, "w_down holds 3 experts"),
        (fe, (x.int(), q_gate_up, q_down, weights, ids), TypeError, "hidden_states"),
        (fe, (x, q_gate_up, q_down, weights, ids + E), ValueError, "topk_ids"),
        (fe, (x, q_gate_up, q_down, weights[:2], ids[:2]), ValueError, "topk_ids"),
        (fe, (x, q_gate_up, q_down, weights, ids, {"activation": "gelu"}), ValueError, "activation"),
        (fe, (x, q_gate_up, q_down.to("meta"), weights, ids), ValueError, "w_down is on meta"),
        ("moe_forward", (x, torch.randn(E + 1, H), q_gate_up, q_down, 2), ValueError, "router_weight"),
        ("moe_forward", (x, torch.randn(E, H), q_gate_up, q_down, E + 1), ValueError, "top_k"),
        ("moe_forward", (x, torch.randn(E, H), q_gate_up, q_down, 2, {"shared_gate_up": dense_gate_up[0]}),
         ValueError, "shared"),
        ("quantize_experts", (dense_gate_up, dense_down, {"group_size": 48}), ValueError, "group_size"),
        ("quantize_experts", (dense_gate_up, dense_down, {"group_size": 64}), ValueError, "group_size"),
        ("quantize_experts", (dense_gate_up, dense_down, {"fmt": "int8"}), ValueError, "fmt"),
        ("quantize_experts", (dense_gate_up, dense_down, {"fmt": "nf4", "zero_point": True}), ValueError,
         "zero_point"),
        ("quantize_experts", (dense_gate_up, dense_down, {"zero_point": "float", "group_size": -1}), ValueError,
         "zero_point"),
        ("quantize_experts", (dense_gate_up, dense_down, {"group_size": 32.0}), TypeError, "group_size"),
        ("quantize_experts", (dense_gate_up.int(), dense_down), TypeError, "w_gate_up"),
        ("quantize_experts", (dense_gate_up, dense_down[:, :, :16]), ValueError, "w_down"),
        ("quantize_experts", (dense_gate_up, dense_down.tolist()), TypeError, "w_down"),
        ("quantize_experts", (dense_gate_up * float("nan"), dense_down, {"group_size": 32}), ValueError, "w_gate_up"),
        ("QuantizedExperts", (q_gate_up.qweight.float(), q_gate_up.scales, q_gate_up.shape, 32), ValueError,
         "qweight"),
        ("QuantizedExperts", (q_gate_up.qweight, q_gate_up.scales[:, :3], q_gate_up.shape, 32), ValueError, "scales"),
        ("replace", (q_gate_up, {"zeros": q_gate_up.zeros.float()}), ValueError, "zeros"),
        ("replace", (q_gate_up, {"zeros": None, "mins": q_gate_up.scales.float()}), ValueError, "mins"),
        ("replace", (q_gate_up, {"fmt": "nf4"}), ValueError, "zeros|codebook"),
        ("replace", (q_gate_up, {"group_size": -1}), ValueError, "scales"),
        ("replace", (q_gate_up, {"codebook": torch.zeros(16)}), ValueError, "codebook"),
        ("experts", (q_gate_up, 1), TypeError, "index"),
    ], dataclasses


def test_bad_input(k):
    calls, dataclasses = _bad_calls(k)
    for name, args, error, match in calls:
        kwargs = args[-1] if isinstance(args[-1], dict) else {}
        args = args[:-1] if kwargs else args
        if name == "replace":
            fn = dataclasses.replace
        elif name == "experts":
            fn = type(args[0]).experts
        else:
            fn = getattr(k, name)
        with pytest.raises(error, match=match):
            fn(*args, **kwargs)


def test_expert_parallel_refused(k):
    q_gate_up, q_down = quantized_experts(k, 4, 96, 32, "int4", False, 32, torch.bfloat16)
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    weights, ids = routing("balanced", 2, 4, 2)
    with pytest.raises(ValueError, match="expert_parallel"):
        k.fused_experts(x, q_gate_up, q_down, weights, ids, expert_parallel=object())
    with pytest.raises(ValueError, match="expert_parallel"):
        k.moe_forward(x, torch.randn(4, 96), q_gate_up, q_down, 2, expert_parallel=object())


# ----------------------------------------------------------------------------------------------------
# transformers
# ----------------------------------------------------------------------------------------------------


def tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64)
    return MixtralForCausalLM(config).float().eval()


@pytest.mark.parametrize("tokens", [3])
def test_transformers_4bit_experts(k, path, monkeypatch, tokens):
    """A random Mixtral whose experts are quantized in place (quantize_experts_module) runs through
    ExpertsInterface and matches the eager model with the dequantized weights (fp32: 1e-4)."""
    from transformers.integrations.moe import ExpertsInterface

    model = tiny_mixtral()
    experts = model.model.layers[0].mlp.experts
    input_ids = torch.randint(0, 96, (1, tokens))
    k.quantize_experts_module(experts, group_size=32, zero_point=True)
    assert isinstance(experts.gate_up_proj, k.QuantizedExperts)
    reference = tiny_mixtral()
    ref_experts = reference.model.layers[0].mlp.experts
    with torch.no_grad():
        ref_experts.gate_up_proj.copy_(k.dequantize(experts.gate_up_proj, torch.float32))
        ref_experts.down_proj.copy_(k.dequantize(experts.down_proj, torch.float32))
        reference.set_experts_implementation("eager")
        eager = reference(input_ids).logits
        monkeypatch.setitem(ExpertsInterface._global_mapping, "moe_dispatch", k.experts_forward)
        model.set_experts_implementation("moe_dispatch")
        ours = model(input_ids).logits
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)


def test_transformers_refuses_foreign_quantization(k):
    """Experts weights quantized by other schemes are refused with a ValueError naming the weight."""
    model = tiny_mixtral()
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(3, 64)
    weights, ids = routing("balanced", 3, 4, 2)
    packed = torch.zeros(4, 64, 32, dtype=torch.uint8)  # a bitsandbytes-like uint8 pack
    del experts.down_proj
    experts.down_proj = torch.nn.Parameter(packed, requires_grad=False)
    with pytest.raises(ValueError, match="down_proj is quantized by a scheme"):
        k.experts_forward(experts, x, ids, weights)
    experts = tiny_mixtral().model.layers[0].mlp.experts
    experts.gate_up_proj_scales = torch.ones(4, 64, 2)  # MXFP4-style companion tensors
    with pytest.raises(ValueError, match="gate_up_proj_scales"):
        k.experts_forward(experts, x, ids, weights)
    experts = tiny_mixtral().model.layers[0].mlp.experts
    q_gate_up, _ = k.quantize_experts(experts.gate_up_proj.detach(), experts.down_proj.detach(), group_size=32)
    del experts.gate_up_proj
    experts.gate_up_proj = q_gate_up  # quantized gate/up, float down
    with pytest.raises(ValueError, match="quantize both"):
        k.experts_forward(experts, x, ids, weights)


# ----------------------------------------------------------------------------------------------------
# The benchmark's 4-bit rows (their code paths that need no GPU)
# ----------------------------------------------------------------------------------------------------


def test_bench_random_layers_and_goals(k, monkeypatch):
    """The benchmark's random 4-bit experts are valid QuantizedExperts of the model's shapes that run; the 4-bit
    goals read the 4-bit rows and the bf16 row of the same T."""
    from hubtools.bench import moe_dispatch as bench

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = bench.Model(4, 2, 128, 128, dict(scoring="softmax", renormalize=True), (1,))
    spec = bench.QUANT_FORMATS["int4-g128"]
    (layer,) = bench.make_quantized_layers(k, model, 1, spec, device="cpu")
    assert layer.w_gate_up.shape == (256, 128) and layer.w_down.shape == (128, 128)
    # per expert: gate/up 256 x 128 codes + one group of 256 bf16 scales; down 128 x 128 codes + 128 scales
    assert bench.quant_expert_bytes(k, model, spec) == 256 * 64 + 256 * 2 + 128 * 64 + 128 * 2
    assert bench.quant_expert_bytes(k, model, spec) == layer.w_gate_up.expert_nbytes() + layer.w_down.expert_nbytes()
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    out = k.moe_forward(x, layer.router, layer.w_gate_up, layer.w_down, 2)
    assert torch.isfinite(out).all() and 0.05 < out.float().std() < 20  # sane magnitudes for the bench check
    rows = [
        {"case": "mixtral-8x7b T=1", "impl": "ours", "seconds": 40e-6},
        {"case": "mixtral-8x7b T=1", "impl": "weight-stream bound", "seconds": 36e-6},
        {"case": "mixtral-8x7b 4bit-int4-g128 T=1", "impl": "ours", "seconds": 12e-6},
        {"case": "mixtral-8x7b 4bit-int4-g128 T=1", "impl": "weight-stream bound", "seconds": 10e-6},
        {"case": "mixtral-8x7b T=4096", "impl": "ours", "seconds": 5e-3},
        {"case": "mixtral-8x7b 4bit-int4-g128 T=4096", "impl": "ours", "seconds": 6e-3},
        {"case": "mixtral-8x7b 4bit-int4-g128 T=4096", "impl": "weight-stream bound", "seconds": 1e-4},
    ]
    goals = {g["goal"]: g for g in bench.goals({"rows": rows})}
    assert goals["4-bit T=1 time / 4-bit weight-stream bound"]["value"] == pytest.approx(1.2)
    assert not goals["4-bit T=1 time / 4-bit weight-stream bound"]["met"]  # 85 % of the bound: at most 1.18
    assert goals["4-bit T>=4096: bf16 time / 4-bit time"]["value"] == pytest.approx(5 / 6)
    assert goals["4-bit T>=4096: bf16 time / 4-bit time"]["met"]
    assert goals["4-bit T=1: bf16 time / 4-bit time"]["value"] == pytest.approx(40 / 12)
    assert goals["T=1 time / weight-stream bound"]["case"] == "mixtral-8x7b T=1"


def test_quantize_in_chunks(k, monkeypatch):
    """Experts quantized a few at a time (large models) give the same bits as all at once."""
    w_gate_up, w_down = make_experts(5, 96, 32, torch.bfloat16, seed=4)
    whole = k.quantized.quantize(w_down, group_size=32, zero_point=True)
    monkeypatch.setattr(k.quantized, "QUANTIZE_CHUNK_ELEMENTS", 2 * 96 * 32)
    chunked = k.quantized.quantize(w_down, group_size=32, zero_point=True)
    for field in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(chunked, field), getattr(whole, field))
    assert chunked.mins is None and chunked.num_experts == 5


def test_fake_tensors_and_no_data_reads(k):
    """The 4-bit ops' fake kernels give the output's shape under FakeTensorMode (what torch.compile traces)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q_gate_up, q_down = quantized_experts(k, 4, 96, 32, "nf4", False, 32, torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(3, 96, dtype=torch.bfloat16))
        weights, ids = mode.from_tensor(torch.rand(3, 2)), mode.from_tensor(torch.zeros(3, 2, dtype=torch.int32))
        fake = [k.QuantizedExperts(**{**vars(q), **{f: mode.from_tensor(t) for f, t in q.tensors().items()}})
                for q in (q_gate_up, q_down)]
        out = k.ops.fused_experts_4bit(x, *fake[0].flat(), *fake[1].flat(), 32, weights, ids, "silu")
        assert out.shape == (3, 96) and out.dtype == torch.bfloat16
        router = mode.from_tensor(torch.randn(4, 96))
        out = k.ops.moe_forward_4bit(x, router, *fake[0].flat(), *fake[1].flat(), 32, 2, "softmax", True, None,
                                     None, None, 1.0, None, None)
        assert out.shape == (3, 96)
