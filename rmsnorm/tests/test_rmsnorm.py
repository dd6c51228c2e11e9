"""rmsnorm on CPU: the Triton kernels through the interpreter and the PyTorch path, against float64.

References are float64 with the kernel's rounding points (Llama rounds x * rstd to the input dtype before
the weight multiply; Gemma rounds once at the end), so the tolerance is a couple of ulps of the output
dtype. Shapes stay small: the interpreter runs every program in Python.
"""

from __future__ import annotations

from types import MethodType

import pytest
import torch

from conftest import INTERPRETED
from references import rms_norm_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("rmsnorm")


def rtol(dtype: torch.dtype) -> float:
    """Two ulps of the output (one for a flipped rounding of x * rstd, one for the final rounding), and
    one more for bfloat16 because the Triton interpreter truncates fp32 -> bf16 casts where the GPU rounds
    to nearest even."""
    if dtype == torch.float32:
        return 1e-5
    return (3 if dtype == torch.bfloat16 else 2) * torch.finfo(dtype).eps


def assert_same_sum(total, expected, path):
    """x + residual rounds like the unfused add: bit-exact, but for the interpreter's bf16 truncation."""
    if path == "triton" and total.dtype == torch.bfloat16:
        torch.testing.assert_close(total, expected, rtol=torch.finfo(total.dtype).eps, atol=0)
    else:
        assert torch.equal(total, expected), "x + residual must round exactly like the unfused add"


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol(dtype), atol=1e-5, equal_nan=True)


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(dtype)


SHAPES = [(1, 1), (3, 2), (4, 7), (17, 64), (5, 100), (64, 257), (2, 1000), (3, 4096)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_float64(k, path, dtype, offset):
    torch.manual_seed(0)
    for m, h in SHAPES:
        x, w = rand(m, h, dtype=dtype, scale=3.0), rand(h, dtype=dtype)
        out = k.rms_norm(x, w, 1e-6, offset=offset)
        assert out.dtype == dtype and out.shape == x.shape
        assert_close(out, rms_norm_reference(x, w, 1e-6, offset)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_add_rms_norm_matches_float64(k, path, dtype, offset):
    torch.manual_seed(1)
    for m, h in SHAPES:
        x, r, w = rand(m, h, dtype=dtype), rand(m, h, dtype=dtype, scale=4.0), rand(h, dtype=dtype)
        out, total = k.fused_add_rms_norm(x, r, w, 1e-5, offset=offset)
        ref_out, ref_total = rms_norm_reference(x, w, 1e-5, offset, residual=r)
        assert_same_sum(total, ref_total, path)
        assert_close(out, ref_out, dtype)


def test_no_weight_and_leading_dims(k, path):
    torch.manual_seed(2)
    x = rand(2, 3, 5, 48, dtype=torch.bfloat16)
    out = k.rms_norm(x, None, 1e-6)
    assert out.shape == x.shape
    assert_close(out, rms_norm_reference(x, None)[0], torch.bfloat16)


def test_weight_dtype_promotes_like_llama(k, path):
    """A float32 weight on bfloat16 activations (autocast training) returns float32, as LlamaRMSNorm does."""
    torch.manual_seed(3)
    x, w = rand(6, 40, dtype=torch.bfloat16), rand(40)
    out = k.rms_norm(x, w)
    assert out.dtype == torch.float32
    assert_close(out, rms_norm_reference(x, w)[0], torch.bfloat16)
    gemma = k.rms_norm(x, w, offset=1.0)
    assert gemma.dtype == torch.bfloat16


@pytest.mark.skipif(not INTERPRETED, reason="needs triton with TRITON_INTERPRET=1")
def test_looped_path_for_rows_wider_than_a_block(k, monkeypatch):
    """H above the widest single-block entry takes the two-pass kernels, forward and backward."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    h = 70000
    assert k.ops.triton_kernels.launch_config("forward", h)["looped"]
    assert k.ops.triton_kernels.launch_config("backward", h)["looped"]
    torch.manual_seed(4)
    x, r, w = rand(3, h, dtype=torch.bfloat16), rand(3, h, dtype=torch.bfloat16), rand(h, dtype=torch.bfloat16)
    assert_close(k.rms_norm(x, w), rms_norm_reference(x, w)[0], torch.bfloat16)
    out, total = k.fused_add_rms_norm(x, r, w, offset=1.0)
    ref_out, ref_total = rms_norm_reference(x, w, offset=1.0, residual=r)
    assert_same_sum(total, ref_total, "triton")
    assert_close(out, ref_out, torch.bfloat16)
    check_grads(k, x, w, r, offset=0.0)


def test_large_dynamic_range(k, path):
    """Rows scaled from 1e-12 to 1e12 and rows mixing huge and tiny entries keep fp32 statistics exact."""
    torch.manual_seed(5)
    scales = 10.0 ** torch.linspace(-12, 12, 25)
    x = torch.randn(25, 300) * scales[:, None]
    x[::3, ::7] *= 1e6
    w = rand(300)
    assert_close(k.rms_norm(x, w), rms_norm_reference(x, w)[0], torch.float32)
    xh = (torch.randn(25, 300) * 10.0 ** torch.linspace(-3, 4, 25)[:, None]).to(torch.float16)
    assert_close(k.rms_norm(xh, w.half()), rms_norm_reference(xh, w.half())[0], torch.float16)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("h", [6, 300])
def test_nan_and_inf_stay_in_their_row(k, path, h):
    """Multi-row programs (small H) must not leak a row's NaN or inf into the rows sharing the program."""
    torch.manual_seed(6)
    x, w = rand(12, h, dtype=torch.bfloat16), rand(h, dtype=torch.bfloat16)
    x[3, 1] = float("nan")
    x[7, 0] = float("inf")
    out = k.rms_norm(x, w)
    clean = [i for i in range(12) if i not in (3, 7)]
    assert torch.isfinite(out[clean]).all()
    assert out[3].isnan().all()
    assert_close(out, rms_norm_reference(x, w)[0], torch.bfloat16)


def test_non_contiguous_inputs(k, path):
    """Row-strided views run in place; other layouts take one copy; results equal the contiguous ones."""
    torch.manual_seed(7)
    qkv = rand(4, 5, 3 * 64, dtype=torch.bfloat16)
    w = rand(64, dtype=torch.bfloat16)
    strided = qkv[..., 64:128]  # a QKV split: rows 192 apart
    assert torch.equal(k.rms_norm(strided, w), k.rms_norm(strided.contiguous(), w))
    transposed = rand(64, 9, dtype=torch.bfloat16).t()  # columns not contiguous
    assert torch.equal(k.rms_norm(transposed, w), k.rms_norm(transposed.contiguous(), w))
    gapped = qkv[:, ::2, :64]  # leading dims that do not collapse into one row stride
    residual = rand(*gapped.shape, dtype=torch.bfloat16)
    expected = k.fused_add_rms_norm(gapped.contiguous(), residual, w)
    for got, want in zip(k.fused_add_rms_norm(gapped, residual.transpose(-1, -2).contiguous().transpose(-1, -2), w), expected):
        assert torch.equal(got, want)
    w_strided = rand(128, dtype=torch.bfloat16)[::2]
    assert torch.equal(k.rms_norm(strided, w_strided), k.rms_norm(strided, w_strided.contiguous()))


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 0)])
def test_empty(k, path, shape):
    x = torch.randn(shape, dtype=torch.bfloat16)
    w = torch.randn(shape[-1], dtype=torch.bfloat16, requires_grad=True)
    out = k.rms_norm(x, w)
    assert out.shape == x.shape and out.dtype == x.dtype
    normed, total = k.fused_add_rms_norm(x, x.clone(), w)
    assert normed.shape == total.shape == x.shape
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("contiguous", [True, False])
def test_fused_add_inplace(k, path, contiguous):
    """inplace=True: the sum goes into residual, the output into x, and both are returned."""
    torch.manual_seed(8)
    base_x, base_r = rand(6, 2, 96, dtype=torch.bfloat16), rand(6, 2, 96, dtype=torch.bfloat16)
    w = rand(96, dtype=torch.bfloat16)
    x, r = (base_x.clone(), base_r.clone()) if contiguous else (base_x.clone()[::2], base_r.clone()[::2])
    expected_out, expected_total = k.fused_add_rms_norm(x.clone(), r.clone(), w, offset=1.0)
    got_x, got_r = k.fused_add_rms_norm(x, r, w, offset=1.0, inplace=True)
    assert got_x is x and got_r is r
    assert torch.equal(x, expected_out) and torch.equal(r, expected_total)


def check_grads(k, x, w, r=None, offset=0.0, eps=1e-6):
    """Gradients of the kernel's op against float64 autograd of the same formula (rounding ignored)."""
    dtype = x.dtype
    xs = [t.detach().clone().requires_grad_() for t in (x, w) + ((r,) if r is not None else ())]
    dy = torch.randn(x.shape).to(dtype)
    if r is None:
        out = k.rms_norm(xs[0], xs[1], eps, offset=offset)
        got = torch.autograd.grad(out, xs, dy)
    else:
        d_total = torch.randn(x.shape).to(dtype)
        out, total = k.fused_add_rms_norm(xs[0], xs[2], xs[1], eps, offset=offset)
        got = torch.autograd.grad((out, total), xs, (dy, d_total))
    x64 = (x.double() if r is None else (x.double() + r.double()).to(dtype).double()).requires_grad_()
    w64 = w.double().requires_grad_()
    xhat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    y64 = xhat * (w64 + offset)
    want = list(torch.autograd.grad(y64, (x64, w64), dy.double()))
    if r is not None:
        want[0] = want[0] + d_total.double()
        want.append(want[0])
    limit = 1e-5 if dtype == torch.float32 else 1e-2
    for name, g, ref in zip(("x", "weight", "residual"), got, want):
        assert g.dtype == (dtype if name != "weight" else w.dtype)
        error = ((g.double() - ref).norm() / ref.norm()).item()
        assert error < limit, f"grad of {name}: relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_autograd(k, path, dtype, offset):
    torch.manual_seed(9)
    for m, h in [(5, 3), (37, 100), (9, 1000)]:
        x, w, r = rand(m, h, dtype=dtype, scale=2.0), rand(h, dtype=dtype), rand(m, h, dtype=dtype)
        check_grads(k, x, w, offset=offset)
        check_grads(k, x, w, r, offset=offset)


def test_autograd_without_weight_and_frozen_weight(k, path):
    torch.manual_seed(10)
    x = rand(7, 33).requires_grad_()
    (gx,) = torch.autograd.grad(k.rms_norm(x, None), x, torch.ones(7, 33))
    x64 = x.detach().double().requires_grad_()
    (gx64,) = torch.autograd.grad(x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6), x64, torch.ones(7, 33))
    torch.testing.assert_close(gx.double(), gx64, rtol=1e-5, atol=1e-6)
    w = rand(33)  # does not require grad: only dx is computed
    (gx_w,) = torch.autograd.grad(k.rms_norm(x, w).sum(), x)
    assert gx_w.shape == x.shape


@pytest.mark.skipif(not INTERPRETED, reason="needs triton with TRITON_INTERPRET=1")
@pytest.mark.parametrize("m, h", [(1, 1), (13, 5), (9, 100), (3, 40000)])
def test_launchers_write_every_element(k, monkeypatch, m, h):
    """Outputs poisoned with NaN: single-block and looped kernels, tails of multi-row programs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = k.ops.triton_kernels
    torch.manual_seed(11)
    x, r, w = rand(m, h, dtype=torch.bfloat16), rand(m, h, dtype=torch.bfloat16), rand(h, dtype=torch.bfloat16)
    out, total = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    kernels.forward(x, r, w, out, total, 1e-6, 0.0)
    ref_out, ref_total = rms_norm_reference(x, w, residual=r)
    assert_same_sum(total, ref_total, "triton")
    assert_close(out, ref_out, torch.bfloat16)
    grad_x, grad_w = torch.full_like(x, float("nan")), torch.full_like(w, float("nan"))
    kernels.backward(x, total, w, r, grad_x, grad_w, 1e-6, 0.0)
    assert torch.isfinite(grad_x).all() and torch.isfinite(grad_w).all()


def test_bad_input(k):
    x, w = torch.randn(4, 8), torch.randn(8)
    cases = [
        (lambda: k.rms_norm(x, torch.randn(7)), ValueError, "weight"),
        (lambda: k.rms_norm(x, torch.randn(2, 4)), ValueError, "weight"),
        (lambda: k.rms_norm(x.to(torch.int32), w), TypeError, "x"),
        (lambda: k.rms_norm(x.double(), w), TypeError, "x"),
        (lambda: k.rms_norm(x, w.to(torch.int64)), TypeError, "weight"),
        (lambda: k.rms_norm(torch.tensor(1.0), None), ValueError, "x"),
        (lambda: k.rms_norm(x, w.to("meta")), ValueError, "weight"),
        (lambda: k.rms_norm(x, None, offset=1.0), ValueError, "offset"),
        (lambda: k.rms_norm(x, w, -1e-6), ValueError, "eps"),
        (lambda: k.fused_add_rms_norm(x, x.half(), w), TypeError, "residual"),
        (lambda: k.fused_add_rms_norm(x, x[:, :4], w), ValueError, "residual"),
        (lambda: k.fused_add_rms_norm(x, x.to("meta"), w), ValueError, "residual"),
        (lambda: k.fused_add_rms_norm(x.bfloat16(), x.bfloat16(), w, inplace=True), TypeError, "inplace"),
        (lambda: k.fused_add_rms_norm(x, x.clone(), w.requires_grad_(), inplace=True), ValueError, "inplace"),
    ]
    for call, error, word in cases:
        with pytest.raises(error, match=word):
            call()


def test_ops_pass_opcheck(k, monkeypatch):
    """Schema, fake kernels and autograd registration are consistent (what torch.compile relies on)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(12)
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    ops = k.ops
    torch.library.opcheck(ops.rms_norm, (x.requires_grad_(), w.requires_grad_(), 1e-6, 0.0))
    torch.library.opcheck(ops.fused_add_rms_norm, (x, r, w, 1e-6, 1.0))
    torch.library.opcheck(ops.fused_add_rms_norm_inplace, (x.detach().clone(), r.clone(), w.detach(), 1e-6, 0.0))
    torch.library.opcheck(ops.rms_norm_backward, (torch.randn(3, 16), x.detach(), w.detach(), None, 1e-6, 0.0, True))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    torch.manual_seed(13)
    model = LlamaForCausalLM(config).eval()
    for name, param in model.named_parameters():
        if "norm" in name:  # norms start at ones: randomize so a wrong weight would show
            param.data.uniform_(0.5, 1.5)
    return model


def test_kernelize_llama(k, built_kernel_dir, monkeypatch):
    """kernelize swaps every LlamaRMSNorm forward for layers.RMSNorm; logits and grads stay the same."""
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 12))
    want = model(ids).logits
    want_grads = torch.autograd.grad(model(ids).logits.square().sum(), [model.model.norm.weight])
    mapping = {"RMSNorm": {"cpu": LocalLayerRepository(repo_path=built_kernel_dir("rmsnorm"), layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(m.forward.__func__ is k.layers.RMSNorm.forward for m in norms)
    torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    got_grads = torch.autograd.grad(model(ids).logits.square().sum(), [model.model.norm.weight])
    torch.testing.assert_close(got_grads[0], want_grads[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_match_transformers_modules(k, path, dtype):
    """Each layer's forward, bound to the transformers module it replaces, reproduces that module."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(14)
    x = rand(3, 5, 72, dtype=dtype)
    llama, gemma = LlamaRMSNorm(72, eps=1e-5).to(dtype), GemmaRMSNorm(72, eps=1e-5).to(dtype)
    for module in (llama, gemma):
        module.weight.data.copy_(torch.randn(72))
    got = MethodType(k.layers.RMSNorm.forward, llama)(x)
    assert got.dtype == llama(x).dtype
    assert_close(got, llama(x), dtype)
    got = MethodType(k.layers.RMSNormZeroCentered.forward, gemma)(x)
    assert got.dtype == gemma(x).dtype
    assert_close(got, gemma(x), dtype)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton with TRITON_INTERPRET=1")
def test_launch_tables_apply_only_to_their_gpu(k, monkeypatch, caplog):
    """configs/nvidia-h200.json is read on an H200 only; another GPU takes the heuristic and says so once."""
    tk, cuda = k.ops.triton_kernels, torch.device("cuda", 0)
    tk._note_heuristic.cache_clear()
    monkeypatch.setattr(tk, "_device_name", lambda device: "NVIDIA H200")
    tuned = tk.tuned_table("NVIDIA H200")["forward"]["4096"]
    assert tk.launch_config("forward", 4096, cuda) == {"looped": False, "block": 4096, **tuned}
    monkeypatch.setattr(tk, "_device_name", lambda device: "Some Other GPU")
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert tk.launch_config("forward", 4096, cuda) == tk.heuristic_config("forward", 4096)
    messages = [r.getMessage() for r in caplog.records if "no tuned forward launch" in r.getMessage()]
    assert len(messages) == 1 and "no configs/some-other-gpu.json" in messages[0]
