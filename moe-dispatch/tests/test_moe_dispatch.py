"""moe-dispatch on CPU: the Triton kernels through the interpreter and the PyTorch path, small shapes.

References are float64 loops over (token, slot) pairs written independently of the kernel's code.
Tolerances (relative to the reference's norm / max): fp32 1e-5; fp16 4e-3 (about 4 roundings of
2^-11); bf16 2.5e-2: the interpreter converts fp32 -> bf16 by truncation (2^-7 per rounding, three
roundings: SiLU*up, weighted expert output, final sum), on GPUs it rounds to nearest.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("moe-dispatch")


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


def assert_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output (unwritten or poisoned elements)"
    diff = out.double() - ref
    tol = TOL[dtype]
    assert diff.norm() <= tol * ref.norm(), f"relative error {(diff.norm() / ref.norm()).item():.2e} > {tol}"
    assert diff.abs().max() <= 4 * tol * ref.abs().max()


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


# T <= 16 runs the decode kernels, larger T the sort + grouped GEMMs (CHUNK_TOKENS = 64: T=130 is 3 chunks)
@pytest.mark.parametrize(
    "T,E,H,I,top_k,kind,dtype",
    [
        (1, 4, 32, 16, 2, "balanced", torch.bfloat16),
        (5, 8, 64, 48, 3, "balanced", torch.float16),
        (16, 6, 32, 32, 2, "skewed", torch.bfloat16),
        (17, 8, 64, 48, 2, "empty", torch.bfloat16),
        (40, 5, 32, 16, 3, "balanced", torch.float32),
        (130, 8, 32, 32, 2, "skewed", torch.float16),
        (70, 8, 48, 24, 2, "balanced", torch.bfloat16),
    ],
)
def test_fused_experts(k, path, T, E, H, I, top_k, kind, dtype):
    x = torch.randn(T, H).to(dtype)
    w_gate_up, w_down = make_experts(E, H, I, dtype)
    weights, ids = routing(kind, T, E, top_k)
    out = k.fused_experts(x, w_gate_up, w_down, weights, ids)
    assert_close(out, experts_float64(x, w_gate_up, w_down, weights, ids), dtype)


@pytest.mark.parametrize("T", [3, 70])
def test_every_output_element_written(k, monkeypatch, T):
    """The Triton launcher writes into a NaN-poisoned output; int64 ids, duplicate slots, bf16 weights."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    E, H, I = 4, 32, 16
    x = torch.randn(T, H, dtype=torch.float16)
    w_gate_up, w_down = make_experts(E, H, I, torch.float16)
    ids = torch.randint(0, E, (T, 3), dtype=torch.int64)
    ids[0] = 2  # the same expert in every slot of token 0
    weights = torch.rand(T, 3).to(torch.bfloat16)
    out = torch.full((T, H), float("nan"), dtype=torch.float16)
    k.ops.triton_kernels.experts(x, w_gate_up, w_down, weights, ids, out)
    assert_close(out, experts_float64(x, w_gate_up, w_down, weights, ids), torch.float16)


def test_out_of_range_ids_select_nothing_in_kernels(k, monkeypatch):
    """Ids outside [0, E) (the expert-parallel sentinel convention) contribute zero; no stray access."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    E, H, I, T = 4, 32, 16, 20
    x = torch.randn(T, H, dtype=torch.float32)
    w_gate_up, w_down = make_experts(E, H, I, torch.float32)
    weights, ids = routing("balanced", T, E, 2)
    bad = ids.clone()
    bad[::3, 1] = E + 5
    bad[1::3, 0] = -1
    kept = weights * ((bad >= 0) & (bad < E))
    for tokens in (T, 4):  # grouped and decode kernels
        out = torch.full((tokens, H), float("nan"))
        k.ops.triton_kernels.experts(x[:tokens], w_gate_up, w_down, weights[:tokens], bad[:tokens], out)
        assert_close(out, experts_float64(x[:tokens], w_gate_up, w_down, kept[:tokens], ids[:tokens]), torch.float32)


STREAM_PLANS = {  # (gate_up, down) plans of the T = 1 stream kernels: K not a multiple of BLOCK_K, rows of BLOCK_N
    "even": ({"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
             {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 2, "num_stages": 3}),
    "one-step": ({"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 2, "num_stages": 3},
                 {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}),
}


@pytest.mark.parametrize("plans", sorted(STREAM_PLANS))
@pytest.mark.parametrize("programs_per_sm", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stream_kernels_one_token(k, monkeypatch, plans, programs_per_sm, dtype):
    """T = 1 through the stream kernels (config "STREAM"): items split over programs (the interpreter has 4 SMs:
    4 or 12 programs over 12-50 items), into a NaN-poisoned output; a duplicate expert, an out-of-range id and the
    shared expert (id E, its own tensors) among the slots; H and I not multiples of BLOCK_N / BLOCK_K."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    E, H, I = 6, 40, 24
    x = torch.randn(1, H).to(dtype)
    w_gate_up, w_down = make_experts(E, H, I, dtype)
    shared = make_experts(1, H, I, dtype, seed=1)
    ids = torch.tensor([[3, 0, 3, E + 2, E]], dtype=torch.int32)  # expert 3 twice, one id picking nothing
    weights = torch.rand(1, 5) + 0.1
    up, down = STREAM_PLANS[plans]
    out = torch.full((1, H), float("nan"), dtype=dtype)
    k.ops.triton_kernels.experts(x, w_gate_up, w_down, weights, ids, out, shared_gate_up=shared[0][0],
                                 shared_down=shared[1][0],
                                 config={"STREAM": programs_per_sm, "gate_up": up, "down": down})
    all_gu, all_dn = torch.cat([w_gate_up, shared[0]]), torch.cat([w_down, shared[1]])
    kept = weights * (ids < E + 1)
    ref = experts_float64(x, all_gu, all_dn, kept, torch.where(ids < E + 1, ids, 0))
    assert_close(out, ref, dtype)


def test_stream_config_checked(k, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(1, 32)
    w_gate_up, w_down = make_experts(4, 32, 16, torch.float32)
    weights, ids = routing("balanced", 1, 4, 2)
    up, down = STREAM_PLANS["even"]
    with pytest.raises(ValueError, match="STREAM"):
        k.ops.triton_kernels.experts(x, w_gate_up, w_down, weights, ids, torch.empty(1, 32),
                                     config={"STREAM": 0, "gate_up": up, "down": down})


ROUTINGS = {
    "mixtral": dict(scoring="softmax", renormalize=True),
    "qwen2": dict(scoring="softmax", renormalize=False),
    "deepseek": dict(scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2, scaling=2.5, bias=True),
    "sigmoid_plain": dict(scoring="sigmoid", renormalize=False),
}


@pytest.mark.parametrize("mode", sorted(ROUTINGS))
@pytest.mark.parametrize("T", [1, 37])
def test_route(k, path, mode, T):
    spec = dict(ROUTINGS[mode])
    E, top_k = 16, 4
    logits = torch.randn(T, E)
    bias = torch.randn(E) * 0.3 if spec.pop("bias", False) else None
    scaling = spec.pop("scaling", 1.0)
    weights, ids = k.route(logits, top_k, correction_bias=bias, scaling_factor=scaling, **spec)
    ref_w, ref_ids = route_float64(logits, top_k, bias=bias, scaling=scaling, **spec)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, top_k)
    # same experts, each with its weight (order within a row is not part of the contract)
    order, ref_order = ids.sort(1), ref_ids.sort(1)
    assert torch.equal(order.values, ref_order.values.to(torch.int32))
    torch.testing.assert_close(weights.gather(1, order.indices).double(), ref_w.gather(1, ref_order.indices),
                               rtol=1e-5, atol=1e-6)
    assert all(len(set(row.tolist())) == top_k for row in ids)


@pytest.mark.parametrize("mode", ["mixtral", "deepseek"])
@pytest.mark.parametrize("router_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 4])
def test_router_gemv(k, monkeypatch, mode, router_dtype, T):
    """The decode router (logits of <= ROUTER_GEMV_MAX_TOKENS tokens from `_router_gemv_kernel`, then the routing
    kernel): H ending inside a column tile and E inside a row block, so the last tiles and programs are masked;
    the same experts and weights as routing F.linear's logits in the router's dtype (bf16 logits: within one
    rounding of them, 2^-7 relative, as the interpreter truncates to bf16 where GPUs round to nearest)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tk = k.ops.triton_kernels
    assert T <= tk.ROUTER_GEMV_MAX_TOKENS
    spec = dict(ROUTINGS[mode])
    E, H, top_k = 21, 1100, 4
    spec.pop("bias", None)
    scaling = spec.pop("scaling", 1.0)
    if spec.get("num_groups"):
        spec.update(num_groups=7, topk_groups=3)
    x = torch.randn(T, H).to(torch.bfloat16)
    router_weight = (torch.randn(E, H) / H**0.5).to(router_dtype)
    bias = torch.randn(E) * 0.3 if mode == "deepseek" else None
    routing_args = (top_k, spec["scoring"] == "sigmoid", spec["renormalize"], bias, spec.get("num_groups", 1),
                    spec.get("topk_groups", 1), scaling)
    weights, ids = tk.route(None, *routing_args, hidden_states=x, router_weight=router_weight)
    ref_w, ref_ids = route_float64(F.linear(x.to(router_dtype), router_weight).float(), top_k, bias=bias,
                                   scaling=scaling, **spec)
    order, ref_order = ids.sort(1), ref_ids.sort(1)
    assert torch.equal(order.values, ref_order.values.to(torch.int32))
    rtol = 1e-5 if router_dtype == torch.float32 else 2**-6
    torch.testing.assert_close(weights.gather(1, order.indices).double(), ref_w.gather(1, ref_order.indices),
                               rtol=rtol, atol=1e-6)


def test_route_fp16_logits(k, path):
    logits = torch.randn(9, 8).to(torch.float16)
    weights, ids = k.route(logits, 2)
    ref_w, ref_ids = route_float64(logits.float(), 2)
    assert torch.equal(ids.sort(1).values, ref_ids.sort(1).values.to(torch.int32))
    torch.testing.assert_close(weights.sum(1), torch.ones(9))


def moe_float64(x, router_weight, w_gate_up, w_down, top_k, shared=None, **spec):
    """Logits rounded like F.linear in the router weight's dtype, then the float64 routing and experts."""
    logits = F.linear(x.to(router_weight.dtype), router_weight)
    weights, ids = route_float64(logits, top_k, **spec)
    out = experts_float64(x, w_gate_up, w_down, weights, ids)
    if shared is not None:
        out += experts_float64(x, shared[0][None], shared[1][None], torch.ones(x.shape[0], 1),
                               torch.zeros(x.shape[0], 1, dtype=torch.int64))
    return out


@pytest.mark.parametrize("T", [2, 6, 70])
@pytest.mark.parametrize("mode,shared_i", [("mixtral", None), ("deepseek", None), ("deepseek", 16), ("deepseek", 24)])
def test_moe_forward(k, path, T, mode, shared_i):
    """Router fp32 (selection far from ties), experts bf16; a shared expert fused (I'=I) or separate."""
    spec = dict(ROUTINGS[mode])
    E, H, I, top_k, dtype = 8, 32, 16, 3, torch.bfloat16
    x = torch.randn(T, H).to(dtype)
    router_weight = torch.randn(E, H) / H**0.5
    w_gate_up, w_down = make_experts(E, H, I, dtype)
    bias = torch.randn(E) * 0.3 if spec.pop("bias", False) else None
    scaling = spec.pop("scaling", 1.0)
    shared = make_experts(1, H, shared_i, dtype, seed=1) if shared_i else None
    out = k.moe_forward(x, router_weight, w_gate_up, w_down, top_k, correction_bias=bias, scaling_factor=scaling,
                        shared_gate_up=shared[0][0] if shared else None, shared_down=shared[1][0] if shared else None,
                        **spec)
    ref = moe_float64(x, router_weight, w_gate_up, w_down, top_k, bias=bias, scaling=scaling,
                      shared=(shared[0][0], shared[1][0]) if shared else None, **spec)
    assert_close(out, ref, dtype)


def test_moe_forward_leading_dims_and_fp32(k, path):
    x = torch.randn(2, 3, 32)
    router_weight = torch.randn(4, 32)
    w_gate_up, w_down = make_experts(4, 32, 16, torch.float32)
    out = k.moe_forward(x, router_weight, w_gate_up, w_down, 2)
    assert out.shape == x.shape
    ref = moe_float64(x.reshape(6, 32), router_weight, w_gate_up, w_down, 2)
    assert_close(out.reshape(6, 32), ref, torch.float32)


def test_strided_inputs(k, path):
    """Views with a non-unit last stride (sliced activations, weights, bias) give the contiguous result."""
    E, H, I, T = 8, 32, 16, 20
    x = torch.randn(T, 2 * H, dtype=torch.float16)[:, ::2]
    w_gate_up, w_down = make_experts(E, H, I, torch.float16)
    w_down_view = w_down.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major
    bias = torch.randn(2 * E)[::2] * 0.3
    router_weight = torch.randn(E, H) / H**0.5
    spec = dict(scoring="sigmoid", correction_bias=bias, num_groups=4, topk_groups=2)
    out = k.moe_forward(x, router_weight, w_gate_up, w_down_view, 3, **spec)
    ref = k.moe_forward(x.contiguous(), router_weight, w_gate_up, w_down, 3,
                        **{**spec, "correction_bias": bias.contiguous()})
    # The kernels load the same values whatever the strides: bit-equal. The PyTorch path hands the views to
    # CPU BLAS, whose summation order follows the memory layout: within one fp16 rounding (2^-10 relative).
    exact = path == "triton"
    torch.testing.assert_close(out, ref, rtol=0 if exact else 2**-10, atol=0 if exact else 1e-5)


def test_deterministic(k, path):
    x = torch.randn(70, 32, dtype=torch.bfloat16)
    w_gate_up, w_down = make_experts(8, 32, 16, torch.bfloat16)
    weights, ids = routing("balanced", 70, 8, 2)
    first = k.fused_experts(x, w_gate_up, w_down, weights, ids)
    assert torch.equal(first, k.fused_experts(x, w_gate_up, w_down, weights, ids))


def test_zero_tokens(k, path):
    w_gate_up, w_down = make_experts(4, 32, 16, torch.bfloat16)
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    weights, ids = k.route(torch.empty(0, 4), 2)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)
    assert k.fused_experts(x, w_gate_up, w_down, weights, ids).shape == (0, 32)
    assert k.moe_forward(x, torch.randn(4, 32), w_gate_up, w_down, 2).shape == (0, 32)


def _bad_calls():
    E, H, I, T = 4, 32, 16, 3
    x = torch.randn(T, H, dtype=torch.bfloat16)
    w_gate_up, w_down = make_experts(E, H, I, torch.bfloat16)
    weights, ids = routing("balanced", T, E, 2)
    fe = "fused_experts"
    return [
        (fe, (x, w_gate_up[:, :, :16], w_down, weights, ids), ValueError, "w_gate_up"),
        (fe, (x, w_gate_up, w_down[:3], weights, ids), ValueError, "w_gate_up"),
        (fe, (x, w_gate_up[:, :30], w_down, weights, ids), ValueError, "w_gate_up"),
        (fe, (x, w_gate_up, w_down.float(), weights, ids), TypeError, "w_down"),
        (fe, (x.int(), w_gate_up, w_down, weights, ids), TypeError, "hidden_states"),
        (fe, (x, w_gate_up, w_down, weights, ids.float()), TypeError, "topk_ids"),
        (fe, (x, w_gate_up, w_down, weights[:2], ids[:2]), ValueError, "topk_ids"),
        (fe, (x, w_gate_up, w_down, weights[:, :1], ids), ValueError, "topk_ids"),
        (fe, (x, w_gate_up, w_down, weights, ids + E), ValueError, "topk_ids"),
        (fe, (x, w_gate_up, w_down, weights, ids - 3), ValueError, "topk_ids"),
        (fe, (x, w_gate_up, w_down, torch.rand(T, 5), torch.zeros(T, 5, dtype=torch.int32)), ValueError, "top_k"),
        (fe, (x[0], w_gate_up, w_down, weights, ids), ValueError, "hidden_states"),
        (fe, (x.tolist(), w_gate_up, w_down, weights, ids), TypeError, "hidden_states"),
        ("route", (torch.randn(T, E), E + 1), ValueError, "top_k"),
        ("route", (torch.randn(T, E), 0), ValueError, "top_k"),
        ("route", (torch.randn(T, E), 2.0), TypeError, "top_k"),
        ("route", (torch.randn(T, E), 2, {"scoring": "relu"}), ValueError, "scoring"),
        ("route", (torch.randn(T, E), 2, {"correction_bias": torch.zeros(E + 1)}), ValueError, "correction_bias"),
        ("route", (torch.randn(T, E), 2, {"num_groups": 3, "topk_groups": 1}), ValueError, "num_groups"),
        ("route", (torch.randn(T, E), 2, {"num_groups": 2}), ValueError, "topk_groups"),
        ("route", (torch.randn(T, 8), 4, {"num_groups": 4, "topk_groups": 1}), ValueError, "top_k"),
        ("route", (torch.randn(T), 2), ValueError, "router_logits"),
        ("moe_forward", (x, torch.randn(E, H + 1), w_gate_up, w_down, 2), ValueError, "router_weight"),
        ("moe_forward", (x, torch.randn(E + 1, H), w_gate_up, w_down, 2), ValueError, "router_weight"),
        ("moe_forward", (x, torch.randn(E, H).half(), w_gate_up, w_down, 2), TypeError, "router_weight"),
        ("moe_forward", (x, torch.randn(E, H), w_gate_up, w_down, E + 1), ValueError, "top_k"),
        ("moe_forward", (x, torch.randn(E, H), w_gate_up, w_down, 2, {"shared_gate_up": w_gate_up[0]}),
         ValueError, "shared"),
        ("moe_forward", (x, torch.randn(E, H), w_gate_up, w_down, 2,
                         {"shared_gate_up": w_gate_up[0, :, :8], "shared_down": w_down[0]}), ValueError, "shared"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input(k, path, case):
    name, args, error, match = _bad_calls()[case]
    kwargs = args[-1] if isinstance(args[-1], dict) else {}
    args = args[:-1] if kwargs else args
    with pytest.raises(error, match=match):
        getattr(k, name)(*args, **kwargs)


def test_activation_and_devices_checked(k):
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    w_gate_up, w_down = make_experts(4, 32, 16, torch.bfloat16)
    weights, ids = routing("balanced", 3, 4, 2)
    with pytest.raises(ValueError, match="activation"):
        k.fused_experts(x, w_gate_up, w_down, weights, ids, activation="gelu")
    with pytest.raises(ValueError, match="w_down is on meta"):
        k.fused_experts(x, w_gate_up, w_down.to("meta"), weights, ids)


def tiny_mixtral(dtype):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
                           num_experts_per_tok=2, max_position_embeddings=64)
    return MixtralForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("tokens", [5, 40])
def test_transformers_mixtral_experts_interface(k, path, monkeypatch, tokens):
    """A random Mixtral with its experts switched to this kernel gives the eager experts' logits."""
    from transformers.integrations.moe import ExpertsInterface

    model = tiny_mixtral(torch.float32)
    input_ids = torch.randint(0, 96, (1, tokens))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        eager = model(input_ids).logits
        monkeypatch.setitem(ExpertsInterface._global_mapping, "moe_dispatch", k.experts_forward)
        model.set_experts_implementation("moe_dispatch")
        ours = model(input_ids).logits
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)


def test_transformers_kernelize_layer(k, path, built_kernel_dir):
    """`kernels.kernelize` maps the MoEExperts layer onto MixtralExperts (PyTorch path on CPU)."""
    import kernels
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    model = tiny_mixtral(torch.bfloat16)
    input_ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        eager = model(input_ids).logits.float()
        kernels.replace_kernel_forward_from_hub(MixtralExperts, "MoEExperts")
        mapping = {"MoEExperts": {"cpu": kernels.LocalLayerRepository(built_kernel_dir("moe-dispatch"),
                                                                       layer_name="MoEExperts")}}
        with kernels.use_kernel_mapping(mapping):
            kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
        ours = model(input_ids).logits.float()
    assert type(model.model.layers[0].mlp.experts).forward is not model.model.layers[0].mlp.experts.forward
    # bf16 model: the eager experts round at other places than the kernel (index_add_ in bf16)
    assert (ours - eager).norm() <= 2e-2 * eager.norm()


def test_heuristic_streams_one_token_on_small_experts(k, monkeypatch):
    """Without a tuned table, one token on experts of intermediate size <= 4096 takes the stream kernels (E58b:
    faster on Qwen3-30B-A3B and DeepSeek-V3), long experts (Mixtral) and more tokens the decode kernels."""
    tk, cuda = k.ops.triton_kernels.configs, torch.device("cuda", 0)
    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)
    qwen3, deepseek, mixtral = (128, 2048, 768, 8), (256, 7168, 2048, 8), (8, 4096, 14336, 2)
    for E, H, I, top_k in (qwen3, deepseek):
        config = tk.default_config(1, E, H, I, top_k, cuda)
        assert config["STREAM"] == 4 and config["down"]["BLOCK_K"] == min(256, I)
        assert "STREAM" not in tk.default_config(2, E, H, I, top_k, cuda)
    assert "STREAM" not in tk.default_config(1, *mixtral, cuda)


def test_tuned_configs_apply_only_to_their_gpu(k, monkeypatch, caplog):
    """The H200 tables are read on an H200 only; another GPU takes the heuristic and says so once."""
    pytest.importorskip("triton")
    tk, cuda, shape = k.ops.triton_kernels.configs, torch.device("cuda", 0), (8, 4096, 14336)
    tk._note_heuristic.cache_clear()
    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)
    monkeypatch.setattr(tk, "_device_name", lambda device: "NVIDIA H200")
    tuned = tk._tuned_configs(*shape, torch.bfloat16, "NVIDIA H200")[1]
    assert tk.get_config(1, *shape, 2, torch.bfloat16, cuda) == tuned
    monkeypatch.setattr(tk, "_device_name", lambda device: "Some Other GPU")
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert tk.get_config(1, *shape, 2, torch.bfloat16, cuda) == tk.default_config(1, *shape, 2, cuda)
    messages = [r.getMessage() for r in caplog.records if "no tuned decode config" in r.getMessage()]
    assert len(messages) == 1 and "some-other-gpu.json" in messages[0]
