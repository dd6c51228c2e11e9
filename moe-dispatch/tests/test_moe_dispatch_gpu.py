"""moe-dispatch on a CUDA GPU: full model sizes against float64, torch.compile, CUDA graphs, transformers.

Tolerances: bf16 operands, fp32 accumulation, three roundings to bf16 (SiLU*up, weighted expert output,
final sum) at 2^-9 each: a relative (norm) error near 4e-3; we allow 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

BF16_TOL = 1e-2
MODELS = {  # E, top_k, H, I, routing
    "mixtral": (8, 2, 4096, 14336, dict(scoring="softmax", renormalize=True)),
    "deepseek": (256, 8, 7168, 2048, dict(scoring="sigmoid", renormalize=True, num_groups=8, topk_groups=4,
                                          scaling_factor=2.5)),
    "qwen3": (128, 8, 2048, 768, dict(scoring="softmax", renormalize=True)),
}


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("moe-dispatch")


@pytest.fixture(scope="module")
def layers():
    """One random layer per model, built on first use (DeepSeek's has more than 2^31 elements per tensor)."""
    built = {}

    def get(name):
        if name not in built:
            E, top_k, H, I, routing = MODELS[name]
            g = torch.Generator(device="cuda").manual_seed(0)
            w_gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()
            w_down = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
            router = (torch.randn(E, H, device="cuda", generator=g) / H**0.5).float()
            built.clear()  # one model's weights at a time
            built[name] = (w_gate_up, w_down, router, top_k, routing)
        return built[name]

    return get


def experts_float64(x, w_gate_up, w_down, weights, ids, token_rows=None):
    """Per-expert float64 loop over the (token, slot) pairs (optionally only for some tokens)."""
    rows = torch.arange(x.shape[0], device=x.device) if token_rows is None else token_rows
    out = torch.zeros(rows.numel(), x.shape[1], dtype=torch.float64, device=x.device)
    intermediate = w_down.shape[2]
    ids, weights = ids[rows], weights[rows]
    for e in ids.unique().tolist():
        local, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = x[rows[local]].double() @ w_gate_up[e].double().T
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out.index_add_(0, local, (act @ w_down[e].double().T) * weights[local, slot, None].double())
    return out


def rel_error(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref).norm() / ref.norm()).item()


def routing_ids(kind, T, E, top_k, device="cuda"):
    g = torch.Generator(device=device).manual_seed(1)
    if kind == "skewed":  # every token on the same top_k experts; all others empty
        ids = torch.arange(top_k, device=device).repeat(T, 1)
    else:
        ids = torch.rand(T, E, device=device, generator=g).argsort(1)[:, :top_k]
    weights = torch.rand(T, top_k, device=device, generator=g) + 0.1
    return weights / weights.sum(1, keepdim=True), ids.int()


@pytest.mark.parametrize("name,T,kind", [
    ("mixtral", 1, "balanced"), ("mixtral", 16, "balanced"), ("mixtral", 300, "balanced"),
    ("deepseek", 1, "balanced"), ("deepseek", 700, "balanced"),
    ("qwen3", 4096, "skewed"), ("qwen3", 2000, "balanced"), ("qwen3", 9, "skewed"),
])
def test_fused_experts_full_size(k, layers, name, T, kind):
    w_gate_up, w_down, _, top_k, _ = layers(name)
    E, H = w_down.shape[:2]
    x = torch.randn(T, H, device="cuda").bfloat16()
    weights, ids = routing_ids(kind, T, E, top_k)
    out = torch.full_like(x, float("nan"))
    k.ops.triton_kernels.experts(x, w_gate_up, w_down, weights, ids, out)
    ref = experts_float64(x, w_gate_up, w_down, weights, ids)
    assert rel_error(out, ref) < BF16_TOL
    assert torch.equal(out, k.fused_experts(x, w_gate_up, w_down, weights, ids))  # deterministic


# T = 1 stream kernels (config "STREAM"): programs per SM, then both GEMVs' (BLOCK_N, BLOCK_K, warps, stages)
STREAM_PLANS = {
    "s2-16x256": (2, (16, 256, 4, 4)), "s4-32x128": (4, (32, 128, 4, 3)), "s3-8x512": (3, (8, 512, 4, 3)),
}


@pytest.mark.parametrize("plan", sorted(STREAM_PLANS))
@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_stream_kernels_full_size(k, layers, plan, name):
    """The T = 1 stream kernels at full model sizes into a NaN-poisoned output, against float64; a duplicate
    expert and an unpicked id among the slots; bit-equal over repeated calls and CUDA-graph replays."""
    w_gate_up, w_down, _, top_k, _ = layers(name)
    E, H = w_down.shape[:2]
    x = torch.randn(1, H, device="cuda").bfloat16()
    weights, ids = routing_ids("balanced", 1, E, top_k)
    ids[0, -1] = ids[0, 0]
    if top_k > 2:
        ids[0, 1] = E  # selects nothing
    programs, (n, kk, warps, stages) = STREAM_PLANS[plan]
    one = {"BLOCK_N": n, "BLOCK_K": kk, "num_warps": warps, "num_stages": stages}
    config = {"STREAM": programs, "gate_up": one, "down": one}
    out = torch.full_like(x, float("nan"))
    k.ops.triton_kernels.experts(x, w_gate_up, w_down, weights, ids, out, config=config)
    kept = weights * (ids < E)
    assert rel_error(out, experts_float64(x, w_gate_up, w_down, kept, ids.clamp(max=E - 1))) < BF16_TOL
    again = torch.full_like(x, float("nan"))
    graph = torch.cuda.CUDAGraph()
    k.ops.triton_kernels.experts(x, w_gate_up, w_down, weights, ids, again, config=config)  # compiled before capture
    with torch.cuda.graph(graph):
        k.ops.triton_kernels.experts(x, w_gate_up, w_down, weights, ids, again, config=config)
    for _ in range(3):
        again.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(again, out)


@pytest.mark.parametrize("name,T", [("mixtral", 1), ("deepseek", 3), ("deepseek", 200), ("qwen3", 1000)])
def test_moe_forward_full_size(k, layers, name, T):
    """Whole block, DeepSeek with a shared expert fused in (same intermediate size as the routed ones)."""
    w_gate_up, w_down, router, top_k, routing = layers(name)
    E, H, I = w_down.shape
    x = torch.randn(T, H, device="cuda").bfloat16()
    bias = torch.randn(E, device="cuda") * 0.05 if name == "deepseek" else None
    shared = (w_gate_up[E - 1].clone(), w_down[E - 1].clone()) if name == "deepseek" else (None, None)
    out = k.moe_forward(x, router, w_gate_up, w_down, top_k, correction_bias=bias, shared_gate_up=shared[0],
                        shared_down=shared[1], **routing)
    weights, ids = k.route(F.linear(x.float(), router), top_k, correction_bias=bias, **routing)
    ref = experts_float64(x, w_gate_up, w_down, weights, ids)
    if shared[0] is not None:
        ones = torch.ones(T, 1, device="cuda")
        ref += experts_float64(x, w_gate_up, w_down, ones, torch.full((T, 1), E - 1, device="cuda"))
    assert rel_error(out, ref) < BF16_TOL


def test_route_matches_torch(k):
    logits = torch.randn(3000, 256, device="cuda")
    bias = torch.randn(256, device="cuda") * 0.1
    weights, ids = k.route(logits, 8, scoring="sigmoid", correction_bias=bias, num_groups=8, topk_groups=4,
                           scaling_factor=2.5)
    scores = logits.sigmoid()
    choice = (scores + bias).view(-1, 8, 32)
    kept = choice.topk(2, -1).values.sum(-1).topk(4, -1).indices
    mask = torch.zeros(3000, 8, dtype=torch.bool, device="cuda").scatter_(1, kept, True)
    ref_ids = choice.masked_fill(~mask[..., None], float("-inf")).view(-1, 256).topk(8, -1).indices
    ref_w = scores.gather(1, ref_ids)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * 2.5
    order, ref_order = ids.sort(1), ref_ids.sort(1)
    assert torch.equal(order.values, ref_order.values.int())
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("T", [1, 4])
def test_router_gemv_full_size(k, name, T):
    """Decode routing (the router GEMV, then the routing kernel as its programmatic dependent on sm_90) against
    routing cuBLAS's logits: the same experts, weights within a bf16 rounding of the logits; in a CUDA graph of
    three calls, bit-equal to the eager call (fixed summation order)."""
    E, top_k, H, _, routing = MODELS[name]
    tk = k.ops.triton_kernels
    assert T <= tk.ROUTER_GEMV_MAX_TOKENS
    g = torch.Generator(device="cuda").manual_seed(1)
    router = (torch.randn(E, H, device="cuda", generator=g) / H**0.5).bfloat16()
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    bias = torch.randn(E, device="cuda", generator=g) * 0.05 if name == "deepseek" else None
    args = (top_k, routing["scoring"] == "sigmoid", routing["renormalize"], bias, routing.get("num_groups", 1),
            routing.get("topk_groups", 1), routing.get("scaling_factor", 1.0))
    weights, ids = tk.route(None, *args, hidden_states=x, router_weight=router)
    ref_w, ref_ids = k.route(F.linear(x, router), top_k, correction_bias=bias, **routing)
    order, ref_order = ids.sort(1), ref_ids.sort(1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices), rtol=2**-7,
                               atol=1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replays = [tk.route(None, *args, hidden_states=x, router_weight=router) for _ in range(3)]
    for w, i in replays:
        w.fill_(float("nan"))
        i.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    for w, i in replays:
        assert torch.equal(w, weights) and torch.equal(i, ids)


def test_64bit_row_offsets(k):
    """Activations with more than 2^31 elements: rows far past 2^31 / H must still be right."""
    T, E, H, I = (2**31 // 2048) + 4096, 4, 2048, 64
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w_gate_up = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).bfloat16()
    w_down = (torch.randn(E, H, I, device="cuda") / I**0.5).bfloat16()
    ids = torch.randint(0, E, (T, 1), device="cuda", dtype=torch.int32)
    weights = torch.ones(T, 1, device="cuda")
    out = k.fused_experts(x, w_gate_up, w_down, weights, ids)
    tail = torch.arange(T - 300, T, device="cuda")
    ref = experts_float64(x, w_gate_up, w_down, weights, ids, token_rows=tail)
    assert rel_error(out[tail], ref) < BF16_TOL


def test_out_of_range_ids_select_nothing(k, layers):
    w_gate_up, w_down, _, top_k, _ = layers("qwen3")
    E, H = w_down.shape[:2]
    for T in (5, 300):
        x = torch.randn(T, H, device="cuda").bfloat16()
        weights, ids = routing_ids("balanced", T, E, top_k)
        bad = ids.clone()
        bad[::2, 3] = E + 7
        bad[1::2, 0] = -1
        kept = weights * ((bad >= 0) & (bad < E))
        out = k.fused_experts(x, w_gate_up, w_down, weights, bad)
        assert rel_error(out, experts_float64(x, w_gate_up, w_down, kept, ids)) < BF16_TOL


@pytest.mark.parametrize("T", [4, 600])
def test_torch_compile_fullgraph(k, layers, T):
    w_gate_up, w_down, router, top_k, routing = layers("qwen3")
    x = torch.randn(T, w_down.shape[1], device="cuda").bfloat16()

    def block(x):
        return k.moe_forward(x * 1.5, router, w_gate_up, w_down, top_k, **routing) + 1.0

    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(x), block(x), rtol=0, atol=0)


@pytest.mark.parametrize("T", [1, 512])
def test_cuda_graph_replay(k, layers, T):
    """Captured once, replayed on new inputs: no host syncs, buffers sized from shapes only."""
    w_gate_up, w_down, router, top_k, routing = layers("mixtral")
    static_x = torch.randn(T, w_down.shape[1], device="cuda").bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        k.moe_forward(static_x, router, w_gate_up, w_down, top_k, **routing)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = k.moe_forward(static_x, router, w_gate_up, w_down, top_k, **routing)
    for _ in range(2):
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.testing.assert_close(static_out, k.moe_forward(static_x, router, w_gate_up, w_down, top_k, **routing),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_transformers_mixtral(k, monkeypatch, dtype, tol):
    """A random Mixtral with its experts switched to this kernel through ExpertsInterface.

    fp32: the kernel's fp32 path (3xTF32) matches the eager experts closely. bf16: eager rounds each
    expert output and accumulates in bf16 (index_add_), we accumulate in fp32, and two layers amplify it.
    """
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.integrations.moe import ExpertsInterface

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=256)
    model = MixtralForCausalLM(config).to("cuda", dtype).eval()
    monkeypatch.setitem(ExpertsInterface._global_mapping, "moe_dispatch", k.experts_forward)
    with torch.no_grad():
        for shape in ((2, 100), (1, 3)):  # grouped and decode kernels
            input_ids = torch.randint(0, 512, shape, device="cuda")
            model.set_experts_implementation("eager")
            eager = model(input_ids).logits.float()
            model.set_experts_implementation("moe_dispatch")
            ours = model(input_ids).logits.float()
            assert (ours - eager).norm() <= tol * eager.norm()
