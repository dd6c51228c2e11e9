"""rmsnorm.fuse_residual_norms on CPU: tiny random transformers decoders (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2,
Gemma 3) with every residual add fused with the norm after it, against the same model unfused.

On the PyTorch path (TRITON_INTERPRET=0) the fused model computes exactly the stock model's arithmetic: the kernel's
sum is the same rounded add (a + b == b + a in IEEE arithmetic) and its norm has LlamaRMSNorm's / GemmaRMSNorm's
fp32 statistics and rounding points (`reference.py`). So logits, generated tokens and hidden states are compared bit
for bit, and every norm has its own random weight: a normalized output used for another tensor, or computed with
another norm's weight, changes them. Each test also checks that the handoffs were taken, i.e. that the fusion ran
(bit-equal logits alone would also hold if no layer ever used a handoff). The Triton interpreter's rounding differs
(`test_interpreter_path_agrees_within_rounding`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import INTERPRETED

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]
ZERO_CENTERED = ("gemma", "gemma2", "gemma3")  # (1 + weight) norms, weights around 0
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, head_dim=16)


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("rmsnorm")


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _config(arch: str, **overrides):
    import transformers

    sizes = {**SIZES, **overrides}
    if arch == "llama":
        return transformers.LlamaConfig(**sizes)
    if arch == "mistral":
        return transformers.MistralConfig(**sizes, sliding_window=None)
    if arch == "qwen2":  # biases on q, k and v
        return transformers.Qwen2Config(**sizes)
    if arch == "qwen3":  # q_norm / k_norm on the projections' outputs
        return transformers.Qwen3Config(**sizes)
    if arch == "gemma":
        return transformers.GemmaConfig(**sizes)
    if arch == "gemma2":  # norms on both sides of each sublayer, logit soft-capping
        return transformers.Gemma2Config(**sizes, sliding_window=8)
    if arch == "gemma3":  # sliding-window and global layers with their own RoPE, q_norm / k_norm
        layers = sizes["num_hidden_layers"]
        layer_types = (["sliding_attention", "full_attention"] * layers)[:layers]
        return transformers.Gemma3TextConfig(**sizes, sliding_window=8, layer_types=layer_types)
    raise AssertionError(arch)


def _model(arch: str, seed: int = 0, dtype=torch.bfloat16, **overrides):
    """A random model whose norms all have their own random weights (stock init gives every norm the same)."""
    import transformers

    torch.manual_seed(seed)
    config = _config(arch, **overrides)
    model = (transformers.Gemma3ForCausalLM(config) if arch == "gemma3"
             else transformers.AutoModelForCausalLM.from_config(config))
    model = model.to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5) if arch in ZERO_CENTERED else param.uniform_(0.5, 1.5)
            elif name.endswith("_proj.bias"):
                param.normal_(0, 0.05)
    return model


def _pair(k, arch: str, **kwargs):
    """(stock model, the same weights fused)."""
    stock = _model(arch, **kwargs)
    fused = copy.deepcopy(stock)
    assert k.fuse_residual_norms(fused) == 2 * stock.config.num_hidden_layers
    return stock, fused


def _tokens(seed: int, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def taken(k, monkeypatch):
    """What each `Handoff.take` answered, in call order: True where the consumer used the handed-off output."""
    answers = []
    take = k.residual_norms.Handoff.take

    def spy(self, hidden_states):
        normed = take(self, hidden_states)
        answers.append(normed is not None)
        return normed

    monkeypatch.setattr(k.residual_norms.Handoff, "take", spy)
    return answers


def _handoffs(model):
    layers = model.model.layers
    return [layer.residual_norms.outgoing for layer in layers]


def _logits(model, tokens, **kwargs):
    with torch.no_grad():
        return model(tokens, **kwargs).logits


# --- the fused model computes the stock one ----------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_fused_model_gives_the_stock_logits(k, torch_path, taken, arch):
    """A padded batch: bit-equal logits, every layer after the first and the final norm took its input from the
    layer before; greedy generate (a prefill and five cached decode steps) gives the same tokens."""
    stock, fused = _pair(k, arch)
    tokens = _tokens(1)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # left padding
    assert torch.equal(_logits(fused, tokens, attention_mask=mask), _logits(stock, tokens, attention_mask=mask))
    layers = stock.config.num_hidden_layers
    assert taken == [True] * layers
    assert all(h.source is None and h.normed is None for h in _handoffs(fused))  # nothing held past the forward
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)  # no stop at a random EOS
    with torch.no_grad():
        want = stock.generate(tokens[:1, :6], **settings)
        got = fused.generate(tokens[:1, :6], **settings)
    assert got.shape == (1, 12) and torch.equal(got, want)
    assert taken == [True] * layers * 7


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kernelized_norms_fuse(k, built_kernel_dir, torch_path, taken, arch):
    """Norms whose forward is already this kernel's layer are read the same way: Llama's through kernels.kernelize,
    Gemma 3's bound by hand the way kernelize binds a layer (transformers does not tag GemmaRMSNorm for the Hub)."""
    from types import MethodType

    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    stock = _model(arch)
    fused = copy.deepcopy(stock)
    if arch == "llama":
        repository = LocalLayerRepository(repo_path=built_kernel_dir("rmsnorm"), layer_name="RMSNorm")
        with use_kernel_mapping({"RMSNorm": {"cpu": repository}}, inherit_mapping=False):
            kernelize(fused, mode=Mode.INFERENCE, device="cpu")
        assert fused.model.norm.forward.__func__ is k.layers.RMSNorm.forward
    else:
        for module in fused.modules():
            if type(module).__name__ == "Gemma3RMSNorm":
                module.forward = MethodType(k.layers.RMSNormZeroCentered.forward, module)
    k.fuse_residual_norms(fused)
    tokens = _tokens(2)
    assert torch.equal(_logits(fused, tokens), _logits(stock, tokens))
    assert taken == [True] * stock.config.num_hidden_layers


def test_hidden_states_are_the_true_sums(k, torch_path, taken):
    """Layers still return residual + mlp_out, so output_hidden_states gives the stock hidden states; transformers'
    capture hooks only record, so under inference mode too (no version counters) the handoffs are taken."""
    stock, fused = _pair(k, "qwen2")
    tokens = _tokens(3)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            want = stock(tokens, output_hidden_states=True).hidden_states
            got = fused(tokens, output_hidden_states=True).hidden_states
        assert len(got) == len(want) == 4 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert taken == [True] * 6


def test_autocast_adds_promote_like_the_model(k, torch_path, taken):
    """fp32 weights under bf16 autocast: sublayer outputs are bf16 on an fp32 residual stream, where the stock add
    promotes; the fused layers add and normalize separately there, with the same result, and still hand off."""
    stock, fused = _pair(k, "llama", dtype=torch.float32)
    tokens = _tokens(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = _logits(stock, tokens), _logits(fused, tokens)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert taken == [True] * 3


def test_gradients_flow_through_the_fused_adds(k, torch_path):
    """Training works: fp32 gradients of every parameter agree with the stock model's (the kernel's backward is its
    own formula, so to fp32 rounding, not bit for bit)."""
    stock, fused = _pair(k, "llama", dtype=torch.float32)
    tokens = _tokens(5)
    grads = []
    for model in (stock, fused):
        model.zero_grad()
        model(tokens).logits.square().mean().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, want in grads[0].items():
        error = ((grads[1][name] - want).norm() / want.norm()).item()
        assert error < 1e-4, (name, error)


def test_compiles_in_one_graph(k, torch_path):
    """torch.compile(fullgraph=True) traces the handoffs away: one graph, 2 L fused add + norms, and only layer 0's
    input norm computed on its own (one rsqrt); the same logits as eager."""
    _, fused = _pair(k, "llama")
    tokens = _tokens(6)
    want = _logits(fused, tokens)
    found = {}

    def backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "call_function":
                name = getattr(node.target, "__name__", str(node.target))
                found[name] = found.get(name, 0) + 1
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend=backend)
    assert torch.equal(_logits(compiled, tokens), want)
    fused_ops = sum(n for name, n in found.items() if "fused_add_rms_norm" in name)
    assert fused_ops == 2 * 3 and found.get("rsqrt") == 1, found
    assert all(h.source is None for h in _handoffs(fused))


@pytest.mark.skipif(not INTERPRETED, reason="needs triton with TRITON_INTERPRET=1")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_interpreter_path_agrees_within_rounding(k, monkeypatch, taken, arch):
    """Through the Triton kernels (interpreter) against the stock PyTorch model. The interpreter truncates fp32 ->
    bf16 casts where PyTorch rounds to nearest, so every norm output and fused sum may sit up to one bf16 ulp
    (2^-8 relative) closer to zero; in these tiny random models, whose logits are small sums that nearly cancel,
    that gives 1.0e-2 to 1.4e-2 relative (Frobenius) on the logits for the kernelized model without the fusion
    too (seeds 0-2, both layouts), and 0.9e-2 to 1.1e-2 fused: the fusion adds no error of its own. 3e-2 leaves
    that margin and still fails a wrong pairing (0.31 / 0.37 when the final norm uses another norm's weight)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    stock, fused = _pair(k, arch, num_hidden_layers=2)
    tokens = _tokens(7, batch=1, seq=6)
    want, got = _logits(stock, tokens).double(), _logits(fused, tokens).double()
    assert ((got - want).norm() / want.norm()).item() < 3e-2
    assert taken == [True] * 2


# --- pairing: a handoff is used for its own tensor and norm only --------------------------------------------

def test_each_handoff_belongs_to_the_next_norm(k, torch_path):
    _, fused = _pair(k, "gemma2")
    layers = fused.model.layers
    for i, layer in enumerate(layers):
        outgoing = layer.residual_norms.outgoing
        consumer = layers[i + 1] if i + 1 < len(layers) else fused.model.norm
        assert outgoing.producer is layer and outgoing.consumer is consumer
        assert outgoing.norm.module is getattr(consumer, "input_layernorm", fused.model.norm)
        assert layer.residual_norms.incoming is (layers[i - 1].residual_norms.outgoing if i else None)
        assert layer.residual_norms.mid.module is layer.pre_feedforward_layernorm
    assert fused.model.norm.residual_norms is layers[-1].residual_norms.outgoing
    assert (fused.model.norm.residual_norms.norm.eps_attribute, fused.model.norm.residual_norms.norm.offset) == (
        "eps", 1.0)


def test_a_skipped_layer_leaves_its_handoff_unused(k, torch_path, taken):
    """The model's loop runs only config.num_hidden_layers layers: the final norm then gets layer 1's output, whose
    handoff holds layer 2's input norm of it. Keyed by consumer, the final norm finds its own handoff empty and
    computes its norm: the stock logits (one handoff keyed by the tensor alone would give layer 2's norm here)."""
    stock, fused = _pair(k, "llama")
    for model in (stock, fused):
        model.config.num_hidden_layers = 2
    tokens = _tokens(8)
    assert torch.equal(_logits(fused, tokens), _logits(stock, tokens))
    assert taken == [True, False]  # layer 1 took layer 0's; the final norm computed its own


def _halve_in_place(module, args, output):
    output.mul_(0.5)


def _halve(module, args, output):
    return output * 0.5


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "compile"])
@pytest.mark.parametrize("hook", [_halve_in_place, _halve])
def test_hidden_states_changed_between_layers_are_seen(k, torch_path, taken, mode, hook):
    """A hook on layer 0 changes its output before layer 1 reads it: out of place (another tensor: identity) or in
    place (the same tensor: its version counter; inference tensors and torch.compile have none, so any hook that
    could write refuses the handoff). Layer 1 then computes its own input norm: the stock model's logits."""
    stock, fused = _pair(k, "mistral")
    for model in (stock, fused):
        model.model.layers[0].register_forward_hook(hook)
    tokens = _tokens(9)
    if mode == "compile":
        torch._dynamo.reset()
        got = _logits(torch.compile(fused, fullgraph=True, backend="aot_eager"), tokens)
    else:
        with getattr(torch, mode)():
            got = fused(tokens).logits
    assert torch.equal(got, _logits(stock, tokens))
    assert taken == [False, True, True]


# --- copies and state ----------------------------------------------------------------------------------------

def test_copies_keep_their_own_wiring_and_the_state_dict(k, torch_path, taken):
    stock, fused = _pair(k, "qwen3")
    assert fused.state_dict().keys() == stock.state_dict().keys()  # the wiring adds no submodule
    twin = copy.deepcopy(fused)
    layers = twin.model.layers
    assert layers[0].residual_norms.outgoing.norm.module is layers[1].input_layernorm
    assert layers[0].residual_norms.outgoing is not fused.model.layers[0].residual_norms.outgoing
    other = _model("qwen3", seed=1)
    k.fuse_residual_norms(other)
    other.load_state_dict(stock.state_dict())  # weights read at each call: a later load counts
    tokens = _tokens(10)
    want = _logits(stock, tokens)
    assert torch.equal(_logits(twin, tokens), want) and torch.equal(_logits(other, tokens), want)
    assert taken == [True] * 6


# --- refusals --------------------------------------------------------------------------------------------------

def _unchanged(model) -> bool:
    return not any("forward" in vars(m) or hasattr(m, "residual_norms") for m in model.modules())


@pytest.mark.parametrize("arch", ["granite", "olmo2"])
def test_unknown_layers_are_refused(k, arch):
    """Granite's layer has Llama's modules but scales each residual branch, Olmo 2's normalizes after each sublayer
    (post_attention_layernorm on attn_out, no input norm): recognised by code, not by their attributes, both are
    refused, naming the layer and its class, and nothing is rewired."""
    import transformers

    if arch == "granite":
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**SIZES, residual_multiplier=0.5))
    else:
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SIZES))
    cls = type(model.model.layers[0]).__name__
    with pytest.raises(ValueError, match=rf"model\.layers\.0 \({cls}\) is not a decoder layer"):
        k.fuse_residual_norms(model)
    assert _unchanged(model)


def test_unknown_norms_and_misuse_are_refused(k):
    model = _model("llama")
    model.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(64)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.post_attention_layernorm \(LayerNorm\) is not an RMSNorm"):
        k.fuse_residual_norms(model)
    assert _unchanged(model)
    model = _model("llama")
    model.model.norm.forward = lambda hidden_states: hidden_states
    with pytest.raises(ValueError, match=r"model\.norm \(LlamaRMSNorm\) runs a forward replaced"):
        k.fuse_residual_norms(model)
    model = _model("llama")
    layer = model.model.layers[2]
    layer.forward = lambda *args, **kwargs: layer.__class__.forward(layer, *args, **kwargs)  # as accelerate's hooks
    with pytest.raises(ValueError, match=r"model\.layers\.2 \(LlamaDecoderLayer\) has its forward replaced"):
        k.fuse_residual_norms(model)
    model = _model("llama")
    k.fuse_residual_norms(model)
    with pytest.raises(ValueError, match="already rewired"):
        k.fuse_residual_norms(model)
    with pytest.raises(ValueError, match="exactly one decoder"):
        k.fuse_residual_norms(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        k.fuse_residual_norms("model")
