"""rmsnorm on the GPU: full sizes against float64, torch.compile(fullgraph=True), CUDA graphs, kernelize,
fuse_residual_norms.

Skipped without CUDA (conftest). Outputs come from the caching allocator, which is filled with NaN
before each call (`poison_allocator`), so an element a kernel fails to write shows as NaN.
"""

from __future__ import annotations

import pytest
import torch

from references import rms_norm_reference

EPS = 1e-6


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("rmsnorm")


def poison_allocator(nbytes: int) -> None:
    """Leave NaN in the cached blocks the next allocations will reuse."""
    torch.empty(nbytes // 4 + 1024, device="cuda").fill_(float("nan"))


def assert_close(actual, expected, dtype):
    rtol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=1e-5)


def rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


# (M, H): goal sizes, non-power-of-two and odd H, decode rows, and the looped path (H > 32768).
SIZES = [(4096, 4096), (1, 7168), (4099, 7168), (128, 5120), (2048, 16384), (333, 4099), (4096, 2048), (64, 65536),
         (3, 100000)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_full_sizes_match_float64(k, dtype):
    torch.manual_seed(0)
    for m, h in SIZES:
        if dtype != torch.bfloat16 and h not in (4096, 7168, 65536):
            continue  # every size in bf16; the other dtypes on a subset (compiles are the cost)
        x, r, w = rand(m, h, dtype=dtype, scale=3.0), rand(m, h, dtype=dtype), rand(h, dtype=dtype)
        nbytes = 4 * x.numel() * x.element_size()
        poison_allocator(nbytes)
        assert_close(k.rms_norm(x, w), rms_norm_reference(x, w)[0], dtype)
        for offset in (0.0, 1.0) if dtype == torch.bfloat16 else (0.0,):
            poison_allocator(nbytes)
            out, total = k.fused_add_rms_norm(x, r, w, offset=offset)
            ref_out, ref_total = rms_norm_reference(x, w, offset=offset, residual=r)
            assert torch.equal(total, ref_total), f"x + residual rounding at M={m} H={h}"
            assert_close(out, ref_out, dtype)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs sm_90+")
@pytest.mark.parametrize("m,h", [(1, 4096), (4099, 7168), (3, 100000)])
def test_dependent_launch_chains(k, monkeypatch, m, h):
    """On sm_90+ the forward kernels launch as programmatic dependents (`triton_kernels._dependent_launch`) and
    let the next kernel launch once their rows are loaded: 12 fused residual norms back to back, each reading the
    sum and output the one before wrote (in place every other step), give the bits of stream-ordered launches,
    eagerly and in CUDA-graph replay with fresh inputs. A kernel that touched memory before its wait would read a
    half-written row."""
    tk = k.ops.triton_kernels
    assert tk._dependent_launch(torch.device("cuda"))
    w = rand(h)

    def chain(x, r):
        for step in range(12):
            x, r = k.fused_add_rms_norm(x, r, w, inplace=step % 2 == 1)
        return x, r

    def serial(x, r):
        with monkeypatch.context() as patch:
            patch.setattr(tk, "_dependent_launch", lambda device: False)
            return chain(x.clone(), r.clone())

    x, r = rand(m, h, scale=3.0), rand(m, h)
    for got, want in zip(chain(x.clone(), r.clone()), serial(x, r)):
        assert torch.equal(got, want)
    static_x, static_r = x.clone(), r.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(static_x.clone(), static_r.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(static_x, static_r)
    for _ in range(3):
        fresh_x, fresh_r = rand(m, h, scale=3.0), rand(m, h)
        want = serial(fresh_x, fresh_r)
        static_x.copy_(fresh_x)
        static_r.copy_(fresh_r)
        graph.replay()
        for got, ref in zip(outs, want):
            assert torch.equal(got, ref)


def check_grads(k, x, w, r=None, offset=0.0):
    xs = [t.clone().requires_grad_() for t in (x, w) + ((r,) if r is not None else ())]
    dy = torch.randn_like(x)
    if r is None:
        got = torch.autograd.grad(k.rms_norm(xs[0], xs[1], offset=offset), xs, dy)
    else:
        d_total = torch.randn_like(x)
        got = torch.autograd.grad(k.fused_add_rms_norm(xs[0], xs[2], xs[1], offset=offset), xs, (dy, d_total))
    x64 = (x.double() if r is None else (x.double() + r.double()).to(x.dtype).double()).requires_grad_()
    w64 = w.double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * (w64 + offset)
    want = list(torch.autograd.grad(y64, (x64, w64), dy.double()))
    if r is not None:
        want[0] = want[0] + d_total.double()
        want.append(want[0])
    for name, g, ref in zip(("x", "weight", "residual"), got, want):
        error = ((g.double() - ref).norm() / ref.norm()).item()
        assert error < 1e-2, f"grad of {name} at {tuple(x.shape)}: relative error {error:.2e}"
    return got


@pytest.mark.parametrize("m, h", [(4096, 4096), (1000, 7168), (512, 16384), (8, 65536)])
def test_backward_full_size_and_deterministic(k, m, h):
    torch.manual_seed(1)
    x, w, r = rand(m, h, scale=2.0), rand(h), rand(m, h)
    poison_allocator(8 * x.numel())
    check_grads(k, x, w)
    check_grads(k, x, w, r, offset=1.0)
    dy = torch.randn_like(x)
    first = k.ops.rms_norm_backward(dy, x, w, None, EPS, 0.0, True)
    second = k.ops.rms_norm_backward(dy, x, w, None, EPS, 0.0, True)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "backward must be deterministic"


def test_torch_compile_fullgraph(k):
    """The ops trace into one graph (no breaks, no recompiles across two same-shape calls), forward and backward."""
    torch.manual_seed(2)

    def block(x, residual, w_llama, w_gemma):
        normed, total = k.fused_add_rms_norm(x, residual, w_llama)
        return k.rms_norm(normed, w_gemma, offset=1.0) + k.rms_norm(total, None), total

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    x, r, w1, w2 = rand(256, 4096), rand(256, 4096), rand(4096), rand(4096)
    leaves = [t.clone().requires_grad_() for t in (x, r, w1, w2)]
    out, total = compiled(*leaves)
    want_out, want_total = block(x, r, w1, w2)
    assert torch.equal(total, want_total)
    # Inductor may fuse the bf16 add with its neighbours; the op outputs themselves are identical.
    torch.testing.assert_close(out, want_out, rtol=torch.finfo(torch.bfloat16).eps, atol=0)
    got_grads = torch.autograd.grad((out.float().square().sum() + total.float().sum()), leaves)
    eager_leaves = [t.clone().requires_grad_() for t in (x, r, w1, w2)]
    e_out, e_total = block(*eager_leaves)
    want_grads = torch.autograd.grad((e_out.float().square().sum() + e_total.float().sum()), eager_leaves)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

    @torch.compile(fullgraph=True, dynamic=False)
    def inplace_step(x, residual, w):
        return k.fused_add_rms_norm(x, residual, w, inplace=True)

    with torch.no_grad():
        xi, ri = x.clone(), r.clone()
        inplace_step(xi, ri, w1)
        want_out, want_total = k.fused_add_rms_norm(x, r, w1)
        assert torch.equal(xi, want_out) and torch.equal(ri, want_total)


def test_cuda_graph_capture(k):
    """Captured forward, fused add (both forms) and backward replay correctly on new data."""
    torch.manual_seed(3)
    x, r, w, dy = rand(512, 7168), rand(512, 7168), rand(7168), rand(512, 7168)
    xi, ri = x.clone(), r.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        k.rms_norm(x, w)
        k.fused_add_rms_norm(x, r, w)
        k.fused_add_rms_norm(xi, ri, w, inplace=True)
        k.ops.rms_norm_backward(dy, x, w, r, EPS, 0.0, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = k.rms_norm(x, w)
        fused_out, total = k.fused_add_rms_norm(x, r, w, offset=1.0)
        k.fused_add_rms_norm(xi, ri, w, inplace=True)
        grad_x, grad_w = k.ops.rms_norm_backward(dy, x, w, r, EPS, 0.0, True)
    for t in (x, r, w, dy):
        t.copy_(torch.randn_like(t))
    xi.copy_(x)
    ri.copy_(r)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, k.rms_norm(x, w))
    want_out, want_total = k.fused_add_rms_norm(x, r, w, offset=1.0)
    assert torch.equal(fused_out, want_out) and torch.equal(total, want_total)
    want_inplace, _ = k.fused_add_rms_norm(x, r, w)
    assert torch.equal(xi, want_inplace) and torch.equal(ri, want_total)
    want_grads = k.ops.rms_norm_backward(dy, x, w, r, EPS, 0.0, True)
    assert torch.equal(grad_x, want_grads[0]) and torch.equal(grad_w, want_grads[1])


def test_inplace_allocates_nothing(k):
    torch.manual_seed(4)
    x, r, w = rand(4096, 4096), rand(4096, 4096), rand(4096)
    k.fused_add_rms_norm(x.clone(), r.clone(), w, inplace=True)  # compile first
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        k.fused_add_rms_norm(x, r, w, inplace=True)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernelize_llama_on_cuda(k, built_kernel_dir, dtype):
    """kernelize replaces every LlamaRMSNorm forward with layers.RMSNorm; logits agree with the original."""
    import transformers
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
    from packaging.version import Version
    from transformers import LlamaConfig, LlamaForCausalLM

    # Older transformers (5.17) ignore kernels 0.17.2 silently; the replaced-forward check below would fail.
    assert Version(transformers.__version__) >= Version("5.19"), transformers.__version__
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    torch.manual_seed(5)
    model = LlamaForCausalLM(config).to("cuda", dtype).eval()
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.uniform_(0.5, 1.5)
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    with torch.no_grad():
        want = model(ids).logits.float()
    mapping = {"RMSNorm": {"cuda": LocalLayerRepository(repo_path=built_kernel_dir("rmsnorm"), layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping):
        kernelize(model, mode=Mode.INFERENCE, device="cuda")
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(m.forward.__func__ is k.layers.RMSNorm.forward for m in norms)
    with torch.no_grad():
        got = model(ids).logits.float()
    # Same rounding points as LlamaRMSNorm: fp32 agrees to rounding; bf16 to a few ulps after two layers.
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def _fused_llama_pair(k, layers=2):
    """(a random bf16 tiny Llama on CUDA with its own random norm weights, a copy with fuse_residual_norms)."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    torch.manual_seed(6)
    stock = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for name, param in stock.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    fused = copy.deepcopy(stock)
    assert k.fuse_residual_norms(fused) == 2 * layers
    return stock, fused


def test_fused_residual_norms_in_a_cuda_graph_and_compiled(k):
    """fuse_residual_norms on CUDA: eager logits agree with the stock model's to bf16 rounding through two layers
    (as kernelize's, above); one forward captured in a CUDA graph (the handoffs are Python state of the capture)
    replays on new tokens to the eager fused logits; torch.compile(fullgraph=True) agrees with eager."""
    stock, fused = _fused_llama_pair(k)
    ids = torch.randint(0, 512, (1, 16), device="cuda")
    with torch.no_grad():
        want = stock(ids, use_cache=False).logits.float()
        got = fused(ids, use_cache=False).logits.float()
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())

    static_ids = ids.clone()
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # Triton compiles, cuBLAS handles, outside the capture
            for _ in range(2):
                fused(static_ids, use_cache=False)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused(static_ids, use_cache=False).logits
    assert all(layer.residual_norms.outgoing.source is None for layer in fused.model.layers)
    new_ids = torch.randint(0, 512, (1, 16), device="cuda")
    static_ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        eager = fused(new_ids, use_cache=False).logits
    torch.testing.assert_close(captured, eager)

    compiled = torch.compile(fused, fullgraph=True, dynamic=False)
    with torch.no_grad():
        got_compiled = compiled(new_ids, use_cache=False).logits.float()
    # Inductor fuses and reorders the stock ops around the kernels (RoPE, SiLU * mul): bf16 rounding, not bits.
    torch.testing.assert_close(got_compiled, eager.float(), rtol=3e-2, atol=3e-2 * eager.float().abs().max().item())
