"""Workloads for `kernels benchmark`: one MoE layer (routing included) at model shapes.

Each `verify_*` returns an fp32 per-expert loop over the same routing (transformers' eager experts
semantics). The runner's timings include Python launch overhead; the graph-replayed numbers are in
docs/benchmarks/moe-dispatch.md.
"""

import torch
import torch.nn.functional as F

import kernels


def _layer(device, experts, hidden, intermediate, dtype=torch.bfloat16):
    # scaled so outputs stay well below 1 and the runner's atol=1e-2 is a few bf16 roundings
    w_gate_up = torch.randn(experts, 2 * intermediate, hidden, device=device, dtype=dtype) / hidden**0.5
    w_down = torch.randn(experts, hidden, intermediate, device=device, dtype=dtype) / (4 * intermediate**0.5)
    router = torch.randn(experts, hidden, device=device, dtype=dtype) / hidden**0.5
    return w_gate_up, w_down, router


def _experts_fp32(x, w_gate_up, w_down, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    intermediate = w_down.shape[2]
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = x[token].float() @ w_gate_up[e].float().T
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out.index_add_(0, token, (act @ w_down[e].float().T) * weights[token, slot, None].float())
    return out.to(x.dtype)


class MoEForward(kernels.Benchmark):
    seed = 0

    def _setup(self, tokens, experts, top_k, hidden, intermediate, **routing):
        self.w_gate_up, self.w_down, self.router = _layer(self.device, experts, hidden, intermediate)
        self.x = torch.randn(tokens, hidden, device=self.device, dtype=torch.bfloat16)
        self.top_k, self.routing = top_k, routing
        self.bias = torch.randn(experts, device=self.device) * 0.01 if routing.get("scoring") == "sigmoid" else None

    def _run(self):
        self.out = self.kernel.moe_forward(self.x, self.router, self.w_gate_up, self.w_down, self.top_k,
                                           correction_bias=self.bias, **self.routing)

    def _reference(self):
        logits = F.linear(self.x, self.router)
        weights, ids = self.kernel.route(logits, self.top_k, correction_bias=self.bias, **self.routing)
        return _experts_fp32(self.x, self.w_gate_up, self.w_down, weights, ids)

    # Mixtral-8x7B decode: one token, two 14336-wide experts streamed from memory
    def setup_mixtral_decode(self):
        self._setup(1, 8, 2, 4096, 14336, scoring="softmax", renormalize=True)

    def benchmark_mixtral_decode(self):
        self._run()

    def verify_mixtral_decode(self):
        return self._reference()

    # Qwen3-30B-A3B prefill: 1024 tokens over 128 small experts, top-8
    def setup_qwen3_prefill(self):
        self._setup(1024, 128, 8, 2048, 768, scoring="softmax", renormalize=True)

    def benchmark_qwen3_prefill(self):
        self._run()

    def verify_qwen3_prefill(self):
        return self._reference()

    # DeepSeek-V3 routing (sigmoid, correction bias, 8 groups / best 4, scale 2.5) on 32 of its experts
    def setup_deepseek_routing(self):
        self._setup(256, 32, 8, 7168, 2048, scoring="sigmoid", renormalize=True, num_groups=8, topk_groups=4,
                    scaling_factor=2.5)

    def benchmark_deepseek_routing(self):
        self._run()

    def verify_deepseek_routing(self):
        return self._reference()

    # Mixtral-8x7B decode with 4-bit experts (int4, groups of 128, round to nearest): the same layer streaming
    # a quarter of the weight bytes
    def setup_mixtral_decode_int4(self):
        self._setup(1, 8, 2, 4096, 14336, scoring="softmax", renormalize=True)
        self.w_gate_up, self.w_down = self.kernel.quantize_experts(self.w_gate_up, self.w_down, group_size=128)

    def benchmark_mixtral_decode_int4(self):
        self._run()

    def verify_mixtral_decode_int4(self):
        logits = F.linear(self.x, self.router)
        weights, ids = self.kernel.route(logits, self.top_k, correction_bias=self.bias, **self.routing)
        w_gate_up, w_down = (self.kernel.dequantize(w, torch.bfloat16) for w in (self.w_gate_up, self.w_down))
        return _experts_fp32(self.x, w_gate_up, w_down, weights, ids)
