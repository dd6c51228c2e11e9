"""Fused projections on the GPU (Triton kernels): a fused decoder layer of a tiny random model gives the unfused
layer's output, compiles in one graph (torch.compile(fullgraph=True), inductor) and replays in a CUDA graph;
the fused model generates. Shapes are the CPU tests' (tests/test_w4a16_fusion.py)."""

import pytest
import torch

from test_w4a16_fusion import SIZES, _gen, _model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = 1e-2  # bfloat16 rounding of each op's output (2**-8 relative), a few ops deep


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("w4a16")


def _rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_layer_compiles_and_replays_in_a_cuda_graph(k, arch, tokens):
    separate = k.quantize_model(_model(arch).cuda(), group_size=64, zero_point=True, fuse=False)
    fused = k.quantize_model(_model(arch).cuda(), group_size=64, zero_point=True)
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, k.fusion.FusedQKVProjection)

    def inputs(seed):
        hidden = torch.randn(1, tokens, SIZES["hidden_size"], generator=_gen(seed)).bfloat16().cuda()
        positions = torch.arange(tokens, device="cuda").unsqueeze(0)
        return hidden, fused.model.rotary_emb(hidden, positions)

    hidden, rotary = inputs(30)
    with torch.no_grad():
        want = _first(layer(hidden, position_embeddings=rotary, attention_mask=None))
        unfused = _first(separate.model.layers[0](hidden, position_embeddings=rotary, attention_mask=None))
        assert _rel_err(want, unfused) < TOL
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True)
        assert _rel_err(_first(compiled(hidden, position_embeddings=rotary, attention_mask=None)), want) < TOL

        static_hidden, static_rotary = hidden.clone(), tuple(t.clone() for t in rotary)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (launch configs, allocator)
            layer(static_hidden, position_embeddings=static_rotary, attention_mask=None)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _first(layer(static_hidden, position_embeddings=static_rotary, attention_mask=None))
        hidden, rotary = inputs(31)
        static_hidden.copy_(hidden)
        for static, new in zip(static_rotary, rotary):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _first(layer(hidden, position_embeddings=rotary, attention_mask=None)))
    assert layer.self_attn.q_proj.handoff.source is None


def test_fused_model_generates(k):
    fused = k.quantize_model(_model("gemma3").cuda(), group_size=64)
    prompt = torch.randint(0, SIZES["vocab_size"], (1, 8), generator=_gen(32)).cuda()
    with torch.no_grad():
        out = fused.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 16) and torch.equal(out[:, :8], prompt)
