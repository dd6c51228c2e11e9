"""Fused projections (quantize_model(..., fuse=True), w4a16.fuse_projections) on CPU: q / k / v and gate / up of
tiny random transformers models run as one matmul each and give the unfused model's logits, bit for bit on the
PyTorch path where no MLP runs the SwiGLU epilogue, within bf16 rounding where one does (`_assert_unfused_logits`);
layouts the fusion does not recognise stay unfused, and misuse raises instead of answering wrong."""

import copy
import json
import logging
from pathlib import Path

import pytest
import torch

# (fmt, zero_point, group_size): every format and group size the fusion must carry over.
FORMATS = [("int4", False, 128), ("int4", True, 64), ("int4", False, 32), ("nf4", False, 64), ("int4", True, -1)]
FORMAT_IDS = [f"{f}-{'zp' if z else 'sym'}-g{g}" for f, z, g in FORMATS]


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("w4a16")


@pytest.fixture
def torch_path(monkeypatch):
    """The PyTorch path (the dispatch reads TRITON_INTERPRET at call time): fp32 products of the dequantized
    weight, so fused and separate matmuls compute each output column the same way."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# --- the claim the fusion rests on: quantization is per output row ------------------------------------------

@pytest.mark.parametrize("fmt,zero_point,group_size", FORMATS, ids=FORMAT_IDS)
def test_quantizing_stacked_rows_is_stacking_quantized_rows(k, fmt, zero_point, group_size):
    """Round-to-nearest and GPTQ (act-order included) of q, k and v stacked along N give the rows of quantizing
    each alone: the same bits, so `concat_weights` of the separate weights is the fused weight."""
    gen = _gen(1)
    parts = [torch.randn(n, 256, generator=gen).to(torch.bfloat16) * 0.05 for n in (96, 32, 32)]
    stacked = torch.cat(parts)
    x = torch.randn(512, 256, generator=gen) @ torch.randn(256, 256, generator=gen) / 16
    hessian = x.t() @ x
    cases = [("rtn", lambda w: k.quantize(w, group_size=group_size, zero_point=zero_point, fmt=fmt))]
    for act_order in (False, True):
        cases.append((f"gptq act_order={act_order}", lambda w, a=act_order: k.gptq_quantize(
            w, hessian, group_size=group_size, zero_point=zero_point, fmt=fmt, act_order=a)))
    for label, quantize in cases:
        whole = quantize(stacked)
        joined = k.fusion.concat_weights([quantize(w) for w in parts])
        assert joined.shape == whole.shape == (160, 256), label
        assert joined.tensors().keys() == whole.tensors().keys(), label
        for field, tensor in whole.tensors().items():
            assert torch.equal(joined.tensors()[field], tensor), (label, field)


# --- tiny transformers models ------------------------------------------------------------------------------

SIZES = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _config(arch: str):
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(**SIZES)
    if arch == "mistral":
        return transformers.MistralConfig(**SIZES, sliding_window=None)
    if arch == "qwen2":  # biases on q, k and v
        return transformers.Qwen2Config(**SIZES)
    if arch == "qwen3":  # q_norm / k_norm on the projections' outputs
        return transformers.Qwen3Config(**SIZES, head_dim=32)
    if arch == "gemma":
        return transformers.GemmaConfig(**SIZES, head_dim=32)
    if arch == "gemma3":  # a sliding-window layer and a global one, q_norm / k_norm
        return transformers.Gemma3TextConfig(**SIZES, head_dim=32, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention"])
    raise AssertionError(arch)


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3"]


def _model(arch: str, seed: int = 7):
    import transformers

    torch.manual_seed(seed)
    config = _config(arch)
    model = (transformers.Gemma3ForCausalLM(config) if arch == "gemma3"
             else transformers.AutoModelForCausalLM.from_config(config))
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():  # q / k / v biases are zero at init: make them count
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0, 0.05)
    return model


def _tokens(seed: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (batch, seq), generator=_gen(seed))


def _logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def _runs_swiglu(k, model) -> bool:
    return any(isinstance(m, k.fusion.GateUpMLP) and m.swiglu for m in model.modules())


# The SwiGLU epilogue rounds the MLP's intermediate once, from fp32, where the unfused MLP rounds gate, up,
# silu(gate) and the product to bf16 (2^-9 relative each); in the bf16 logits that shows as roundings flipped by
# one ulp (2^-8 relative): measured 4.5e-3 to 5.5e-3 relative (Frobenius), at most one ulp per logit, on the four
# SiLU architectures. 1e-2 is 2.5 ulps.
SWIGLU_TOL = 1e-2


def _assert_unfused_logits(k, fused, separate, tokens) -> None:
    """The fused model gives the unfused one's logits: bit for bit (the same products and roundings) unless an MLP
    runs the SwiGLU epilogue, then within SWIGLU_TOL."""
    got, want = _logits(fused, tokens), _logits(separate, tokens)
    if _runs_swiglu(k, fused):
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() < SWIGLU_TOL
    else:
        assert torch.equal(got, want)


def _assert_fused(k, model, lm_head=torch.nn.Linear):
    """Every attention runs q / k / v as one W4A16Linear, every MLP gate / up as one; lm_head is left as it is."""
    layers = model.model.layers
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.q_proj, k.fusion.FusedQKVProjection)
        assert isinstance(attn.k_proj, k.fusion.HandedOffProjection)
        assert isinstance(attn.v_proj, k.fusion.HandedOffProjection)
        assert isinstance(attn.q_proj.qkv, k.W4A16Linear) and isinstance(attn.o_proj, k.W4A16Linear)
        assert isinstance(mlp, k.fusion.GateUpMLP) and isinstance(mlp.gate_up, k.W4A16Linear)
        assert isinstance(mlp.down_proj, k.W4A16Linear)
        assert mlp.swiglu == k.fusion.is_silu(mlp.act_fn)  # SIZES' intermediate size pairs in blocks of 8
    assert lm_head is None or type(model.lm_head) is lm_head


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_model_gives_the_unfused_logits(k, torch_path, arch):
    """Round-to-nearest int4 g64 with zero points: the unfused logits (`_assert_unfused_logits`) and the same greedy
    tokens."""
    tokens = _tokens(10)
    separate = k.quantize_model(_model(arch), group_size=64, zero_point=True, fuse=False)
    fused = k.quantize_model(_model(arch), group_size=64, zero_point=True)
    assert not any(isinstance(m, (k.fusion.FusedQKVProjection, k.fusion.GateUpMLP)) for m in separate.modules())
    _assert_fused(k, fused)
    _assert_unfused_logits(k, fused, separate, tokens)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = separate.generate(tokens[:1, :8], **settings)
        got = fused.generate(tokens[:1, :8], **settings)
    assert got.shape == (1, 14) and torch.equal(got, want)
    handoffs = [layer.self_attn.q_proj.handoff for layer in fused.model.layers]
    assert all(h.source is None and h.outputs == [None, None] for h in handoffs)  # nothing held between calls


@pytest.mark.parametrize("fmt,zero_point,group_size", FORMATS, ids=FORMAT_IDS)
def test_every_format_fuses_exactly(k, torch_path, fmt, zero_point, group_size):
    tokens = _tokens(11)
    kwargs = dict(group_size=group_size, zero_point=zero_point, fmt=fmt)
    separate = k.quantize_model(_model("qwen2"), fuse=False, **kwargs)
    fused = k.quantize_model(_model("qwen2"), **kwargs)
    _assert_fused(k, fused)
    _assert_unfused_logits(k, fused, separate, tokens)


@pytest.mark.parametrize("arch,act_order", [("llama", True), ("qwen3", False), ("gemma3", True)])
def test_gptq_calibration_fuses_exactly(k, torch_path, arch, act_order):
    """GPTQ calibration: q / k / v and gate / up share one Hessian (they read one tensor), so act-order gives them
    one permutation and the fused model computes the unfused one's logits (`_assert_unfused_logits`)."""
    calibration = [_tokens(20 + i, batch=2, seq=32) for i in range(2)]
    tokens = _tokens(12)
    kwargs = dict(group_size=32, zero_point=True, calibration=calibration, act_order=act_order)
    separate = k.quantize_model(_model(arch), fuse=False, **kwargs)
    fused = k.quantize_model(_model(arch), **kwargs)
    _assert_fused(k, fused)
    attn = separate.model.layers[0].self_attn
    if act_order:
        assert attn.q_proj.perm is not None and fused.model.layers[0].self_attn.q_proj.qkv.perm is not None
        assert torch.equal(attn.q_proj.perm, attn.k_proj.perm) and torch.equal(attn.q_proj.perm, attn.v_proj.perm)
    _assert_unfused_logits(k, fused, separate, tokens)


def test_triton_path_agrees_within_rounding(k, path):
    """Through the Triton kernels (interpreted) the fused matmul may take another launch config than the
    separate ones (its N is larger), and the MLPs run the SwiGLU epilogue: the logits agree to bfloat16 rounding
    (SWIGLU_TOL; measured 4.6e-3 on both paths, all of it the epilogue's rounding)."""
    tokens = _tokens(13, batch=1, seq=8)
    separate = k.quantize_model(_model("llama"), group_size=64, fuse=False)
    fused = k.quantize_model(_model("llama"), group_size=64)
    assert _runs_swiglu(k, fused)
    want, got = _logits(separate, tokens).double(), _logits(fused, tokens).double()
    assert ((got - want).norm() / want.norm()).item() < SWIGLU_TOL


def test_concatenated_gate_up_is_bit_exact(k, torch_path, monkeypatch):
    """A SiLU model fused without the SwiGLU epilogue (gate rows, then up rows; act_fn on the matmul's output) gives
    the unfused logits bit for bit: q / k / v and gate / up fuse exactly, only the epilogue rounds differently."""
    tokens = _tokens(22)
    separate = k.quantize_model(_model("qwen3"), group_size=64, zero_point=True, fuse=False)
    monkeypatch.setattr(k.layers, "is_silu", lambda act_fn: False)
    fused = k.quantize_model(_model("qwen3"), group_size=64, zero_point=True)
    assert all(not m.swiglu for m in fused.modules() if isinstance(m, k.fusion.GateUpMLP))
    assert torch.equal(_logits(fused, tokens), _logits(separate, tokens))


def test_intermediate_sizes_that_do_not_pair_keep_act_and_mul(k, torch_path):
    """A SiLU MLP whose intermediate size is not a multiple of 8 fuses gate / up without the epilogue, exactly."""
    import transformers

    torch.manual_seed(23)
    config = transformers.LlamaConfig(**{**SIZES, "intermediate_size": 132})
    models = [transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    separate = k.quantize_model(models[0], group_size=-1, fuse=False)
    fused = k.quantize_model(models[1], group_size=-1)
    mlp = fused.model.layers[0].mlp
    assert isinstance(mlp, k.fusion.GateUpMLP) and not mlp.swiglu
    tokens = _tokens(24)
    assert torch.equal(_logits(fused, tokens), _logits(separate, tokens))


def test_swiglu_layout_round_trips_through_state_dict(k, torch_path, monkeypatch):
    """The gate / up layout is each GateUpMLP's extra state: a state_dict of the SwiGLU layout loaded into a model
    fused the other way (and the reverse) switches its MLPs to the loaded layout and computes the source's logits;
    a state_dict without it (saved before the layout was recorded) is refused by a strict load."""
    tokens = _tokens(25)
    swiglu = k.quantize_model(_model("llama"), group_size=64)
    state = swiglu.state_dict()
    assert int(state["model.layers.0.mlp._extra_state"]) == k.formats.GATE_UP_BLOCK
    with monkeypatch.context() as patch:
        patch.setattr(k.layers, "is_silu", lambda act_fn: False)
        concatenated = k.quantize_model(_model("llama", seed=8), group_size=64)
    assert int(concatenated.state_dict()["model.layers.0.mlp._extra_state"]) == 0
    want_concatenated = _logits(concatenated, tokens)
    other = copy.deepcopy(concatenated)
    other.load_state_dict(state)
    assert all(layer.mlp.swiglu for layer in other.model.layers)
    assert torch.equal(_logits(other, tokens), _logits(swiglu, tokens))
    other.load_state_dict(concatenated.state_dict())
    assert not any(layer.mlp.swiglu for layer in other.model.layers)
    assert torch.equal(_logits(other, tokens), want_concatenated)
    old = {key: value for key, value in state.items() if not key.endswith("_extra_state")}
    with pytest.raises(RuntimeError, match="_extra_state"):
        other.load_state_dict(old)


def test_gate_up_mlp_refuses_what_it_cannot_pair(k):
    """swiglu=True needs SiLU and gate / up rows in whole blocks of 8 (ValueError), and a bool."""
    weight = k.quantize(torch.randn(24, 128), group_size=64)  # 2 I = 24: not a multiple of 16
    down = torch.nn.Identity()
    with pytest.raises(ValueError, match="multiple of 16"):
        k.fusion.GateUpMLP(k.W4A16Linear(weight), down, torch.nn.SiLU(), swiglu=True)
    paired = k.W4A16Linear(k.quantize(torch.randn(32, 128), group_size=64))
    with pytest.raises(ValueError, match="SiLU"):
        k.fusion.GateUpMLP(paired, down, torch.nn.GELU(), swiglu=True)
    with pytest.raises(TypeError, match="swiglu must be a bool"):
        k.fusion.GateUpMLP(paired, down, torch.nn.SiLU(), swiglu=1)
    mlp = k.fusion.GateUpMLP(paired, down, torch.nn.SiLU(), swiglu=True)
    with pytest.raises(ValueError, match="layout"):
        mlp.set_extra_state(torch.tensor(4))


def test_fused_model_copies_saves_and_loads(k, torch_path):
    """deepcopy keeps each attention's handoff shared by its own projections; a state_dict loads into a model
    fused the same way."""
    tokens = _tokens(14)
    fused = k.quantize_model(_model("llama"), group_size=64)
    twin = copy.deepcopy(fused)
    attn = twin.model.layers[0].self_attn
    assert attn.k_proj.handoff is attn.q_proj.handoff is not fused.model.layers[0].self_attn.q_proj.handoff
    other = k.quantize_model(_model("llama", seed=8), group_size=64)
    assert not torch.equal(_logits(other, tokens), _logits(fused, tokens))
    other.load_state_dict(fused.state_dict())
    assert not any(name.startswith(("k_proj", "v_proj")) for name in fused.state_dict())
    assert torch.equal(_logits(other, tokens), _logits(fused, tokens))
    assert torch.equal(_logits(twin, tokens), _logits(fused, tokens))


def test_fused_attention_traces_in_one_graph(k, torch_path):
    """torch.compile(fullgraph=True) takes the handoff (Python state set and cleared in the traced code, checks
    on tensor identity resolved while tracing) with no graph break, and computes what eager does."""
    torch._dynamo.reset()
    model = k.quantize_model(_model("qwen3"), group_size=64)
    layer = model.model.layers[0]
    hidden = torch.randn(2, 8, SIZES["hidden_size"], generator=_gen(15)).bfloat16()
    position_ids = torch.arange(8).unsqueeze(0).expand(2, -1)
    position_embeddings = model.model.rotary_emb(hidden, position_ids)
    with torch.no_grad():
        want = layer(hidden, position_embeddings=position_embeddings, attention_mask=None)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        got = compiled(hidden, position_embeddings=position_embeddings, attention_mask=None)
    want, got = (out[0] if isinstance(out, tuple) else out for out in (want, got))
    assert torch.equal(got, want)
    assert layer.self_attn.q_proj.handoff.source is None


# --- what is not fused -------------------------------------------------------------------------------------

class CrossAttention(torch.nn.Module):
    """q from the hidden states, k and v from another tensor: the three do not read one input."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(128, 64) for _ in range(3))

    def forward(self, hidden_states, context):
        return self.q_proj(hidden_states) + self.k_proj(context) * self.v_proj(context)


class SwappedMLP(torch.nn.Module):
    """The activation on up_proj instead of gate_proj: not the gated MLP GateUpMLP computes."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(128, 64), torch.nn.Linear(128, 64)
        self.down_proj = torch.nn.Linear(64, 128)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = CrossAttention(), SwappedMLP()

    def forward(self, x, context):
        return self.mlp(x) + self.attn(x, context).sum(-1, keepdim=True)


def test_unrecognised_layouts_stay_unfused(k, torch_path, caplog):
    torch.manual_seed(16)
    block = Block().bfloat16()
    x, context = (torch.randn(3, 128, generator=_gen(s)).bfloat16() for s in (17, 18))
    want = k.quantize_model(copy.deepcopy(block), group_size=64, fuse=False)(x, context)
    with caplog.at_level(logging.WARNING):
        model = k.quantize_model(block, group_size=64)
    assert all(type(m) is k.W4A16Linear for m in (model.attn.q_proj, model.attn.k_proj, model.mlp.gate_proj))
    assert "CrossAttention.forward uses k_proj other than as k_proj(hidden_states)" in caplog.text
    assert "SwappedMLP.forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))" in caplog.text
    assert torch.equal(model(x, context), want)


def test_projections_that_disagree_stay_unfused(k, torch_path, caplog):
    """q_proj quantized with groups of 32, k / v with groups of 64 (two quantize_model calls): one matmul
    cannot hold both, so the attention stays as it is; gate / up, all of one format, fuse."""
    model = k.quantize_model(_model("llama"), group_size=32, skip=("k_proj", "v_proj", "lm_head"), fuse=False)
    with caplog.at_level(logging.WARNING):
        k.quantize_model(model, group_size=64)
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.group_size, attn.k_proj.group_size) == (32, 64)
    assert "2 LlamaAttention module(s) left unfused" in caplog.text and "group_size" in caplog.text
    assert isinstance(model.model.layers[0].mlp, k.fusion.GateUpMLP)


def test_concat_weights_refuses_what_differs(k):
    gen = _gen(19)
    weight = torch.randn(64, 256, generator=gen)
    x = torch.randn(512, 256, generator=gen)
    act_order = [k.gptq_quantize(weight, h, group_size=64, act_order=True)
                 for h in (x.t() @ x, (x * torch.linspace(0.1, 2, 256)).t() @ (x * torch.linspace(0.1, 2, 256)))]
    assert not torch.equal(act_order[0].perm, act_order[1].perm)
    with pytest.raises(ValueError, match="perm"):
        k.fusion.concat_weights(act_order)
    cases = {"group_size": dict(group_size=128), "fmt": dict(fmt="nf4"), "zero points": dict(zero_point=True)}
    for problem, kwargs in cases.items():
        with pytest.raises(ValueError, match=problem):
            k.fusion.concat_weights([k.quantize(weight, group_size=64), k.quantize(weight, **{"group_size": 64,
                                                                                                 **kwargs})])
    with pytest.raises(ValueError, match="in_features"):
        k.fusion.concat_weights([k.quantize(weight), k.quantize(weight[:, :128])])
    with pytest.raises(TypeError, match="weights"):
        k.fusion.concat_weights([])


def test_misuse_raises(k, torch_path):
    """A fused k_proj / v_proj answers only right after q_proj, for the tensor q_proj read, once."""
    attn = k.quantize_model(_model("llama"), group_size=64).model.layers[0].self_attn
    x = torch.randn(2, 128, generator=_gen(21)).bfloat16()
    with pytest.raises(RuntimeError, match="k_proj is fused with q_proj"):
        attn.k_proj(x)
    attn.q_proj(x)
    with pytest.raises(RuntimeError, match="v_proj is fused with q_proj"):
        attn.v_proj(x.clone())
    attn.k_proj(x)
    with pytest.raises(RuntimeError, match="k_proj is fused"):
        attn.k_proj(x)
    with pytest.raises(TypeError, match="fuse must be a bool"):
        k.quantize_model(torch.nn.Sequential(torch.nn.Linear(128, 8)), fuse=1)
    with pytest.raises(TypeError, match="model must be"):
        k.fuse_projections("model")


# --- checkpoints -------------------------------------------------------------------------------------------

FIXTURES = sorted(p.parent for p in (Path(__file__).resolve().parent / "fixtures" / "w4a16").glob("*/*/reference.json"))


@pytest.mark.parametrize("folder", FIXTURES, ids=[f"{p.parent.name}/{p.name}" for p in FIXTURES])
def test_checkpoints_fuse_exactly(k, torch_path, folder, caplog):
    """from_pretrained(..., fuse=True) on the tools' own checkpoints (GPTQ act-order, AWQ, compressed-tensors,
    biases, per-channel): the unfused model's logits (`_assert_unfused_logits`)."""
    tokens = torch.tensor(json.loads((folder / "reference.json").read_text())["input_ids"])
    with caplog.at_level(logging.WARNING):
        fused = k.from_pretrained(folder, fuse=True)
    assert "left unfused" not in caplog.text  # the act-order checkpoints give q, k, v (gate, up) one permutation
    _assert_fused(k, fused, lm_head=None)
    _assert_unfused_logits(k, fused, k.from_pretrained(folder), tokens)
