"""moe-dispatch with 4-bit experts on a CUDA GPU (skipped without one): the compiled kernels at model-like sizes
against float64, torch.compile(fullgraph=True), CUDA graphs.

References take the dequantized weights exactly, in float64. Tolerance (relative, norm): the dense kernels'
three bf16 roundings (SiLU*up, weighted output, final sum, 2^-9 each) plus the rounding of each dequantized
weight to bf16 (2^-9, random in sign over K terms): near 5e-3; we allow 1.5e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

TOL = 1.5e-2
FORMATS = {  # name: (fmt, zero_point, group_size)
    "int4-g128": ("int4", False, 128),
    "int4-zp-g32": ("int4", True, 32),
    "int4-min-g64": ("int4", "float", 64),
    "nf4-g64": ("nf4", False, 64),
    "int4-zp-channel": ("int4", True, -1),
}


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("moe-dispatch")


def experts_float64(x, w_gate_up, w_down, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    intermediate = w_down.shape[2]
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = x[token].double() @ w_gate_up[e].double().T
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out.index_add_(0, token, (act @ w_down[e].double().T) * weights[token, slot, None].double())
    return out


MORE_FORMATS = {**FORMATS, "int4-zp-g128": ("int4", True, 128), "int4-g256": ("int4", False, 256)}


def layer(k, E, H, I, name, seed=0, dtype=torch.bfloat16):
    """Random experts of format `name` quantized from `dtype` weights (the generator also returned, for inputs)."""
    fmt, zero_point, group_size = MORE_FORMATS[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w_gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(dtype)
    w_down = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(dtype)
    return k.quantize_experts(w_gate_up, w_down, group_size=group_size, fmt=fmt, zero_point=zero_point), g


def routing(T, E, top_k, skewed=False):
    g = torch.Generator(device="cuda").manual_seed(1)
    if skewed:
        ids = torch.arange(top_k, device="cuda").repeat(T, 1)
    else:
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(1)[:, :top_k]
    weights = torch.rand(T, top_k, device="cuda", generator=g) + 0.1
    return weights / weights.sum(1, keepdim=True), ids.int()


def rel_error(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref).norm() / ref.norm()).item()


def decode_case(k, E, H, I, name, seed, dtype, T, top_k=8):
    """Experts of format `name`, T tokens of x (times 4) and their routing; from T = 2 on, token 1's slots all
    name expert E: it selects nothing."""
    (q_gate_up, q_down), g = layer(k, E, H, I, name, seed=seed, dtype=dtype)
    x = (torch.randn(T, H, device="cuda", generator=g) * 4).to(dtype)
    weights, ids = routing(T, E, top_k)
    if T > 1:
        ids[1] = E
    return q_gate_up, q_down, x, weights, ids


def picked_reference(k, x, q_gate_up, q_down, weights, ids):
    """`experts_float64` of the dequantized experts with the slots that select nothing (ids >= E) weighing 0."""
    E = q_gate_up.num_experts
    return experts_float64(x, k.dequantize(q_gate_up, torch.float32), k.dequantize(q_down, torch.float32),
                           weights * (ids < E), ids.clamp(max=E - 1))


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("T,skewed", [(1, False), (4, True), (5, False), (16, True), (300, False), (1200, True)])
def test_fused_experts_4bit(k, name, T, skewed):
    """E=16, H=2048, I=768 (Qwen3-30B-A3B's expert size), top-8; GEMV (T <= 4; packed-fp16 up to 16), decode
    (T <= 16) and grouped kernels."""
    E, H, I, top_k = 16, 2048, 768, 8
    (q_gate_up, q_down), _ = layer(k, E, H, I, name)
    x = torch.randn(T, H, device="cuda").bfloat16()
    weights, ids = routing(T, E, top_k, skewed)
    out = torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    k.ops.triton_kernels.experts(x, q_gate_up, q_down, weights, ids, out)
    ref = experts_float64(x, k.dequantize(q_gate_up, torch.float32), k.dequantize(q_down, torch.float32), weights,
                          ids)
    assert rel_error(out, ref) <= TOL


PACKED_PLANS = {  # the packed-fp16 GEMVs' launch plans (pointer loads / TMA, x broadcast or not, split-K)
    "tma": {"BLOCK_N": 16, "BLOCK_K": 128, "TILES": 8, "num_warps": 2, "num_stages": 3, "X_BCAST": True, "TMA": True},
    "tma-split3": {"BLOCK_N": 16, "BLOCK_K": 128, "TILES": 2, "num_warps": 4, "num_stages": 4, "X_BCAST": True,
                   "TMA": True, "SPLIT_K": 3},
    "cp-async": {"BLOCK_N": 16, "BLOCK_K": 128, "TILES": 4, "num_warps": 2, "num_stages": 3, "X_BCAST": True},
    "plain": {"BLOCK_N": 8, "BLOCK_K": 128, "TILES": 8, "num_warps": 4, "num_stages": 1, "SPLIT_K": 2},
}


@pytest.mark.parametrize("plan", sorted(PACKED_PLANS))
@pytest.mark.parametrize("name,dtype", [("int4-g128", torch.bfloat16), ("int4-zp-g128", torch.float16),
                                        ("int4-zp-channel", torch.bfloat16), ("int4-g256", torch.float16)])
@pytest.mark.parametrize("T", [1, 3])
def test_packed_gemv_plans(k, plan, name, dtype, T):
    """The packed-fp16 GEMVs' inline PTX under each launch plan, Qwen3-30B-A3B's expert size (E=16), top-8, into a
    NaN-poisoned output; H = 1920 (15 tiles: loop steps past the last tile), large |x| (per-tile fp16 scaling)."""
    E, H, I, top_k = 16, 1792 if name == "int4-g256" else 1920, 768, 8
    (q_gate_up, q_down), g = layer(k, E, H, I, name, seed=3, dtype=dtype)
    assert k.ops.triton_kernels.packed_gemv(q_gate_up, dtype)
    x = (torch.randn(T, H, device="cuda", generator=g) * 40).to(dtype)
    weights, ids = routing(T, E, top_k)
    out = torch.full((T, H), float("nan"), device="cuda", dtype=dtype)
    k.ops.triton_kernels.experts(x, q_gate_up, q_down, weights, ids, out,
                                 config={"GEMV": True, "gate_up": PACKED_PLANS[plan], "down": PACKED_PLANS[plan]})
    ref = experts_float64(x, k.dequantize(q_gate_up, torch.float32), k.dequantize(q_down, torch.float32), weights,
                          ids)
    assert rel_error(out, ref) <= TOL


# E64 / E65 (docs/design/moe-dispatch.md): the gate/up GEMV's trigger at its start, the down GEMV's words loaded
# before its wait, the combine folded into the down GEMV. None may change a bit: a down program that read the
# intermediate before the gate/up grid wrote it, or a fold that summed before the other pairs' rows landed, would.
OVERLAP_VARIANTS = {
    "start": ({"PDL_TRIGGER": "start"}, {}),
    "preload": ({}, {"PRELOAD_WORDS": True}),
    "start-preload": ({"PDL_TRIGGER": "start"}, {"PRELOAD_WORDS": True}),
    "fold": ({}, {"FOLD_COMBINE": True}),
    "start-preload-fold": ({"PDL_TRIGGER": "start"}, {"PRELOAD_WORDS": True, "FOLD_COMBINE": True}),
    # the default of one-step down GEMVs (E68): one-warp programs, 8 rows at one token
    "start-preload-fold-1warp-8rows": ({"PDL_TRIGGER": "start"}, {"PRELOAD_WORDS": True, "FOLD_COMBINE": True,
                                                                  "num_warps": 1, "BLOCK_N": 8}),
    "start-preload-1warp": ({"PDL_TRIGGER": "start"}, {"PRELOAD_WORDS": True, "num_warps": 1}),
}
SIZES = ("BLOCK_N", "num_warps")  # a variant's block sizes: the plan it is compared with has them too


@pytest.mark.parametrize("variant", sorted(OVERLAP_VARIANTS))
@pytest.mark.parametrize("name,dtype", [("int4-g128", torch.bfloat16), ("int4-zp-g128", torch.float16),
                                        ("int4-zp-channel", torch.bfloat16)])
@pytest.mark.parametrize("T", [1, 3])
def test_decode_overlap_bit_equal(k, variant, name, dtype, T):
    """Each variant against the shipped plan (`PACKED_PLANS["tma"]`, dependent launches, with the variant's block
    sizes) on Qwen3-30B-A3B's expert size: five calls and five CUDA-graph replays, each into a NaN-poisoned output,
    all bit-equal to the shipped plan's; within TOL of float64. T = 3 has a token whose pairs select nothing."""
    q_gate_up, q_down, x, weights, ids = decode_case(k, 16, 2048, 768, name, 5, dtype, T)
    plan = {**PACKED_PLANS["tma"], "PDL": True}
    up, down = OVERLAP_VARIANTS[variant]
    sizes = {key: value for key, value in down.items() if key in SIZES}
    shipped = {"GEMV": True, "gate_up": plan, "down": {**plan, **sizes}}
    trial = {"GEMV": True, "gate_up": {**plan, **up}, "down": {**plan, **down}}
    out = assert_calls_bit_equal(k, x, q_gate_up, q_down, weights, ids, shipped, trial)
    if T > 1:
        assert not out[1].any()
    assert rel_error(out, picked_reference(k, x, q_gate_up, q_down, weights, ids)) <= TOL


def assert_calls_bit_equal(k, x, q_gate_up, q_down, weights, ids, reference_config, config):
    """`experts` with `config`, five calls and five CUDA-graph replays into poisoned outputs, each bit-equal to
    one call with `reference_config`; returns the last output."""
    tk = k.ops.triton_kernels
    expected = torch.full(x.shape, float("nan"), device="cuda", dtype=x.dtype)
    tk.experts(x, q_gate_up, q_down, weights, ids, expected, config=reference_config)
    out = torch.empty_like(expected)

    def call():
        out.fill_(float("nan"))
        tk.experts(x, q_gate_up, q_down, weights, ids, out, config=config)

    for _ in range(5):
        call()
        assert torch.equal(out, expected)
    call()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(5):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
    return out


MMA_PLANS = {  # the tensor-core gate/up GEMV's plans (`launch._gate_up_mma`): warps, K-tiles an iteration, ring
    "w4-t4-s2": {"MMA": True, "num_warps": 4, "TILES": 4, "num_stages": 2},
    "w2-t8-s3": {"MMA": True, "num_warps": 2, "TILES": 8, "num_stages": 3, "PDL": True},
    "w1-t2-s4-start": {"MMA": True, "num_warps": 1, "TILES": 2, "num_stages": 4, "PDL": True, "PDL_TRIGGER": "start"},
}


@pytest.mark.parametrize("plan", sorted(MMA_PLANS))
@pytest.mark.parametrize("name,dtype,H", [("int4-g128", torch.bfloat16, 1920), ("int4-zp-g128", torch.float16, 2048),
                                          ("int4-zp-g32", torch.bfloat16, 1952),
                                          ("int4-zp-channel", torch.float16, 1920), ("int4-g256", torch.bfloat16, 1792)])
@pytest.mark.parametrize("T", [1, 3])
def test_mma_gate_up(k, plan, name, dtype, H, T):
    """The tensor-core gate/up GEMV into a NaN-poisoned intermediate: each picked pair's rows within 2^-8 of float64
    silu(gate) * up (x and the dequantized weights exact, fp32 sums), an unpicked pair's rows unwritten; E=16,
    I=768, top-8, H past a loop step's last tile (1920: 15 tiles), past the last tile's columns (1952), and in
    groups of 256. Then the whole layer through `experts` within TOL of float64 (T = 3: a token picks nothing)."""
    E, I, top_k = 16, 768, 8
    q_gate_up, q_down, x, weights, ids = decode_case(k, E, H, I, name, 7, dtype, T, top_k)
    tk = k.ops.triton_kernels
    assert tk.launch.mma_gemv_supported(x, q_gate_up)
    inter = torch.full((T * top_k, I), float("nan"), device="cuda")
    tk.launch._gate_up_mma(x, q_gate_up, inter, ids, MMA_PLANS[plan], MMA_PLANS[plan].get("PDL_TRIGGER") == "start")
    w = k.dequantize(q_gate_up, torch.float32).double()
    for p, e in enumerate(ids.flatten().tolist()):
        if e >= E:
            assert inter[p].isnan().all()
            continue
        gate_up = w[e] @ x[p // top_k].double()
        want = F.silu(gate_up[:I]) * gate_up[I:]
        err = ((inter[p].double() - want).norm() / want.norm()).item()
        assert err <= 2**-8, (p, err)
    out = torch.full((T, H), float("nan"), device="cuda", dtype=dtype)
    up = MMA_PLANS[plan]
    if tk.packed_gemv(q_down, dtype):
        down = {**PACKED_PLANS["tma"], "PDL": True}
    else:  # the fp32 down GEMV: no early trigger for it
        up, down = {key: v for key, v in up.items() if key != "PDL_TRIGGER"}, PACKED_PLANS["plain"]
    tk.experts(x, q_gate_up, q_down, weights, ids, out, config={"GEMV": True, "gate_up": up, "down": down})
    assert rel_error(out, picked_reference(k, x, q_gate_up, q_down, weights, ids)) <= TOL


@pytest.mark.parametrize("name,dtype", [("int4-g128", torch.bfloat16), ("int4-zp-g128", torch.float16)])
@pytest.mark.parametrize("T", [1, 3])
def test_mma_gate_up_keeps_the_fold(k, name, dtype, T):
    """The tensor-core gate/up GEMV zeroes the packed down GEMV's fold counts (its plan's FOLD_COMBINE): the layer
    with the fold, five calls and five CUDA-graph replays into NaN-poisoned outputs, is bit-equal to the same plans
    with the combine launch (the fold sums a token's pairs in the combine's order), on Qwen3-30B-A3B's expert size.
    A count left from the call before would make a fold sum early or never: the repeats would differ."""
    q_gate_up, q_down, x, weights, ids = decode_case(k, 16, 2048, 768, name, 5, dtype, T)
    up = {**MMA_PLANS["w4-t4-s2"], "PDL": True, "PDL_TRIGGER": "start"}
    down = {**PACKED_PLANS["tma"], "PDL": True, "PRELOAD_WORDS": True, "num_warps": 1, "BLOCK_N": 8}
    combined = {"GEMV": True, "gate_up": up, "down": down}
    folded = {"GEMV": True, "gate_up": up, "down": {**down, "FOLD_COMBINE": True}}
    out = assert_calls_bit_equal(k, x, q_gate_up, q_down, weights, ids, combined, folded)
    assert rel_error(out, picked_reference(k, x, q_gate_up, q_down, weights, ids)) <= TOL


MMA_DOWN_PLANS = {
    "w4-t4-s2": {"MMA": True, "num_warps": 4, "TILES": 4, "num_stages": 2, "PDL": True},
    "w2-reps2-t2-s3-split3": {"MMA": True, "num_warps": 2, "REPS": 2, "TILES": 2, "num_stages": 3, "SPLIT_K": 3},
}


@pytest.mark.parametrize("plan", sorted(MMA_DOWN_PLANS))
@pytest.mark.parametrize("name,dtype,H,I", [("int4-g128", torch.bfloat16, 2048, 768),
                                            ("int4-zp-g32", torch.float16, 2016, 800),
                                            ("int4-zp-channel", torch.bfloat16, 2000, 640)])
@pytest.mark.parametrize("T", [1, 3])
def test_mma_down(k, plan, name, dtype, H, I, T):
    """The tensor-core down GEMV behind both gate/up GEMVs (tensor-core and packed / fp32), into a NaN-poisoned
    output, within TOL of float64: E=16, top-8, H with output rows past the last full row block (2016, 2000) or
    not, I past a loop step's last tile (768: 6 tiles) or past the last tile's columns (800); split over K or not.
    T = 3: a token picks nothing."""
    q_gate_up, q_down, x, weights, ids = decode_case(k, 16, H, I, name, 9, dtype, T)
    tk = k.ops.triton_kernels
    ref = picked_reference(k, x, q_gate_up, q_down, weights, ids)
    for up in (MMA_PLANS["w2-t8-s3"], PACKED_PLANS["plain"]):
        out = torch.full(x.shape, float("nan"), device="cuda", dtype=dtype)
        tk.experts(x, q_gate_up, q_down, weights, ids, out, config={"GEMV": True, "gate_up": up,
                                                                       "down": MMA_DOWN_PLANS[plan]})
        if T > 1:
            assert not out[1].any()
        assert rel_error(out, ref) <= TOL


def test_mma_gate_up_refuses(k):
    """MMA with a format it does not take (NF4, float minima), or a tensor-core down GEMV asked for the fold or the
    preload (keys of the packed down GEMV), is a ValueError naming the key, not another kernel's answer."""
    E, H, I, top_k = 4, 1024, 256, 2
    x = torch.randn(1, H, device="cuda").bfloat16()
    weights, ids = routing(1, E, top_k)
    tk = k.ops.triton_kernels
    out = torch.empty(1, H, device="cuda", dtype=torch.bfloat16)
    for name in ("nf4-g64", "int4-min-g64"):
        (q_gate_up, q_down), _ = layer(k, E, H, I, name)
        with pytest.raises(ValueError, match="MMA"):
            tk.experts(x, q_gate_up, q_down, weights, ids, out,
                       config={"GEMV": True, "gate_up": MMA_PLANS["w4-t4-s2"], "down": PACKED_PLANS["plain"]})
    (q_gate_up, q_down), _ = layer(k, E, H, I, "int4-g128")
    with pytest.raises(ValueError, match="FOLD_COMBINE"):
        tk.experts(x, q_gate_up, q_down, weights, ids, out, config={
            "GEMV": True, "gate_up": PACKED_PLANS["tma"], "down": {**MMA_DOWN_PLANS["w4-t4-s2"], "FOLD_COMBINE": True}})
    with pytest.raises(ValueError, match="PRELOAD_WORDS"):
        tk.experts(x, q_gate_up, q_down, weights, ids, out, config={
            "GEMV": True, "gate_up": PACKED_PLANS["tma"], "down": {**MMA_DOWN_PLANS["w4-t4-s2"], "PRELOAD_WORDS": True}})


DOT_OPERANDS = {"packed-swap": (True, True), "packed": (True, False), "fp32-planes": (False, False)}


@pytest.mark.parametrize("operands", sorted(DOT_OPERANDS))
@pytest.mark.parametrize("name,dtype", [("int4-g128", torch.bfloat16), ("int4-zp-g128", torch.float16),
                                        ("int4-zp-channel", torch.bfloat16)])
@pytest.mark.parametrize("T,block_m", [(8, None), (300, 16), (300, 64), (1200, 128)])
def test_dot_operand_plans(k, operands, name, dtype, T, block_m):
    """The tl.dot decode / grouped kernels with int4 operands made by integer ops (PACKED) or fp32 planes, weight
    rows as the MMA's M (SWAP_AB) or not, at each BLOCK_M; E=16, H=1920 (masked last K-tile), I=768, top-8, into
    a NaN-poisoned output."""
    E, H, I, top_k = 16, 1920, 768, 8
    (q_gate_up, q_down), g = layer(k, E, H, I, name, seed=5, dtype=dtype)
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    weights, ids = routing(T, E, top_k)
    packed, swap = DOT_OPERANDS[operands]
    plan = {"BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "PACKED": packed, "SWAP_AB": swap}
    if block_m is None:
        config = {"gate_up": {**plan, "BLOCK_N": 64}, "down": {**plan, "BLOCK_N": 64}}
    else:
        plan = {**plan, "BLOCK_N": 128 if block_m == 64 else 64, "GROUP_M": 8}
        config = {"BLOCK_M": block_m, "gate_up": plan, "down": plan}
    out = torch.full((T, H), float("nan"), device="cuda", dtype=dtype)
    k.ops.triton_kernels.experts(x, q_gate_up, q_down, weights, ids, out, config=config)
    ref = experts_float64(x, k.dequantize(q_gate_up, torch.float32), k.dequantize(q_down, torch.float32), weights,
                          ids)
    assert rel_error(out, ref) <= TOL


@pytest.mark.parametrize("name,dtype", [("int4-g128", torch.bfloat16), ("nf4-g64", torch.float16)])
def test_dequantize_first(k, monkeypatch, name, dtype):
    """Many pairs per expert: the experts dequantized in chunks of columns (a budget of 3 experts' bytes: several
    chunks of gate/up and of down columns, the last ones short) and run by the bf16 grouped kernels; E=16, H=1920,
    I=768, T=1200, top-8 (600 pairs per expert), NaN-poisoned output."""
    E, H, I, T, top_k = 16, 1920, 768, 1200, 8
    tk = k.ops.triton_kernels
    assert T * top_k >= tk.DEQUANT_MIN_PAIRS * E
    monkeypatch.setattr(tk.launch, "DEQUANT_CHUNK_BYTES", 3 * (2 * I * H + H * I) * dtype.itemsize)
    monkeypatch.setattr(tk.launch, "WGMMA_MIN_PAIRS", T * top_k + 1)  # not the Gluon kernel, which Hopper runs here
    (q_gate_up, q_down), g = layer(k, E, H, I, name, seed=7, dtype=dtype)
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    weights, ids = routing(T, E, top_k)
    out = torch.full((T, H), float("nan"), device="cuda", dtype=dtype)
    tk.experts(x, q_gate_up, q_down, weights, ids, out)
    ref = experts_float64(x, k.dequantize(q_gate_up, torch.float32), k.dequantize(q_down, torch.float32), weights,
                          ids)
    assert rel_error(out, ref) <= TOL
    # the chunks dequantized on a second stream (DEQUANT_OVERLAP) or on one: the same arithmetic, so bit-equal, in
    # repeated calls and in a CUDA graph's replays (a missing wait between the streams shows as a difference)
    monkeypatch.setattr(tk.launch, "DEQUANT_OVERLAP", not tk.launch.DEQUANT_OVERLAP)
    other = torch.full_like(out, float("nan"))
    tk.experts(x, q_gate_up, q_down, weights, ids, other)
    assert torch.equal(other, out)
    monkeypatch.setattr(tk.launch, "DEQUANT_OVERLAP", True)
    for _ in range(3):
        other.fill_(float("nan"))
        tk.experts(x, q_gate_up, q_down, weights, ids, other)
        assert torch.equal(other, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.experts(x, q_gate_up, q_down, weights, ids, other)
    for _ in range(3):
        other.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(other, out)


WGMMA_CASES = {  # id: (format, dtype, E, H, I, T, BLOCK_M, skewed, num_stages)
    "g128-bf16-m128": ("int4-g128", torch.bfloat16, 16, 1920, 768, 1200, 128, False, 3),
    "zp-g32-fp16-m64": ("int4-zp-g32", torch.float16, 16, 1920, 768, 300, 64, False, 3),
    "min-g64-bf16-m128-skewed": ("int4-min-g64", torch.bfloat16, 16, 1920, 768, 1200, 128, True, 2),
    "zp-channel-bf16-m64-i704": ("int4-zp-channel", torch.bfloat16, 16, 1920, 704, 300, 64, False, 4),
    "g256-fp16-m128": ("int4-g256", torch.float16, 8, 2048, 768, 700, 128, False, 3),
    "zp-g128-bf16-m128-e64": ("int4-zp-g128", torch.bfloat16, 64, 1024, 512, 2000, 128, False, 3),
}


@pytest.mark.parametrize("case", sorted(WGMMA_CASES))
def test_grouped_wgmma(k, case):
    """The Gluon grouped kernel (config WGMMA; Hopper with the Triton release it was built for) against float64
    into a NaN-poisoned output: every int4 format, fp16 / bf16, BLOCK_M 64 / 128, H = 1920 (K past the last whole
    tile, zero-filled by TMA) and I = 704 (the last column tile's gate box reaching into the up rows and its up
    box past the expert), skewed routing (empty experts, one expert's long run of tiles); then bit-equal over
    repeated calls and CUDA-graph replays (a race between the ring's barriers and its readers would move it)."""
    name, dtype, E, H, I, T, block_m, skewed, stages = WGMMA_CASES[case]
    tk = k.ops.triton_kernels
    top_k = 4
    (q_gate_up, q_down), g = layer(k, E, H, I, name, seed=11, dtype=dtype)
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    if not tk.launch.grouped_wgmma_supported(x, q_gate_up, q_down):
        pytest.skip("the Gluon grouped kernel needs an sm_90 GPU and Triton "
                    f"{' / '.join(tk.launch.GLUON_TRITON_RELEASES)}")
    weights, ids = routing(T, E, top_k, skewed)
    config = {"WGMMA": {"num_stages": stages}, "BLOCK_M": block_m}
    out = torch.full((T, H), float("nan"), device="cuda", dtype=dtype)
    tk.experts(x, q_gate_up, q_down, weights, ids, out, config=config)
    ref = experts_float64(x, k.dequantize(q_gate_up, torch.float32), k.dequantize(q_down, torch.float32), weights,
                          ids)
    assert rel_error(out, ref) <= TOL
    other = torch.full_like(out, float("nan"))
    for _ in range(3):
        other.fill_(float("nan"))
        tk.experts(x, q_gate_up, q_down, weights, ids, other, config=config)
        assert torch.equal(other, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.experts(x, q_gate_up, q_down, weights, ids, other, config=config)
    for _ in range(3):
        other.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(other, out)


def test_compile_and_cuda_graph(k):
    """moe_forward with 4-bit experts under torch.compile(fullgraph=True) and replayed from a CUDA graph."""
    E, H, I, top_k = 8, 1024, 512, 2
    (q_gate_up, q_down), _ = layer(k, E, H, I, "int4-g128")
    router = torch.randn(E, H, device="cuda").bfloat16() / H**0.5
    x = torch.randn(4, H, device="cuda").bfloat16()
    eager = k.moe_forward(x, router, q_gate_up, q_down, top_k)
    compiled = torch.compile(lambda t: k.moe_forward(t, router, q_gate_up, q_down, top_k), fullgraph=True)
    torch.testing.assert_close(compiled(x), eager)
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        k.moe_forward(static, router, q_gate_up, q_down, top_k)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = k.moe_forward(static, router, q_gate_up, q_down, top_k)
    fresh = torch.randn(4, H, device="cuda").bfloat16()
    static.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(out, k.moe_forward(fresh, router, q_gate_up, q_down, top_k))


def test_deepseek_size_decode(k):
    """DeepSeek-V3's expert shapes (E=256, H=7168, I=2048), T=1, int4 g128: 64-bit offsets across experts."""
    E, H, I, top_k = 256, 7168, 2048, 8
    (q_gate_up, q_down), _ = layer(k, E, H, I, "int4-g128")
    x = torch.randn(1, H, device="cuda").bfloat16()
    weights, ids = routing(1, E, top_k)
    ids[0, 0] = E - 1  # the last expert: the largest offsets
    out = k.fused_experts(x, q_gate_up, q_down, weights, ids)
    picked = ids.unique()
    remap = torch.searchsorted(picked, ids.long()).int()
    dequantized = [k.quantized.dequantize_fp32(q, picked) for q in (q_gate_up, q_down)]  # the picked experts only
    ref = experts_float64(x, *dequantized, weights, remap)
    assert rel_error(out, ref) <= TOL
