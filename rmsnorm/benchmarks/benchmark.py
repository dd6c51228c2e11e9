"""`kernels benchmark` workloads for rmsnorm: Llama-3 prefill and decode shapes, bf16.

The runner times each call with a host clock (launch overhead included) and checks `self.out` against
the `verify_*` reference with atol=1e-2. CUDA-graph timings against torch.compile are in
docs/benchmarks/rmsnorm.md (`python scripts/bench.py rmsnorm`).
"""

import torch
from kernels import Benchmark

EPS = 1e-5


def llama_rms_norm(x, weight, eps=EPS):
    """transformers' LlamaRMSNorm: fp32 statistics, cast to the input dtype, then the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNormBenchmark(Benchmark):
    seed = 0

    def _inputs(self, rows, hidden):
        dtype = torch.bfloat16 if self.device != "cpu" else torch.float32
        self.x = torch.randn(rows, hidden, device=self.device, dtype=dtype)
        self.residual = torch.randn(rows, hidden, device=self.device, dtype=dtype)
        self.weight = (1 + 0.1 * torch.randn(hidden, device=self.device)).to(dtype)

    # Llama-3-8B prefill: 4096 tokens of hidden size 4096.
    def setup_llama8b_prefill(self):
        self._inputs(4096, 4096)

    def benchmark_llama8b_prefill(self):
        self.out = self.kernel.rms_norm(self.x, self.weight, EPS)

    def verify_llama8b_prefill(self):
        return llama_rms_norm(self.x, self.weight)

    # Llama-3-70B decode: a batch of 32 tokens of hidden size 8192, with the residual add fused.
    def setup_llama70b_decode_fused_add(self):
        self._inputs(32, 8192)

    def benchmark_llama70b_decode_fused_add(self):
        self.out, _ = self.kernel.fused_add_rms_norm(self.x, self.residual, self.weight, EPS)

    def verify_llama70b_decode_fused_add(self):
        return llama_rms_norm(self.x + self.residual, self.weight)

    # DeepSeek-V3 prefill: hidden size 7168 (not a power of two), 8192 tokens, fused add.
    def setup_deepseek_v3_prefill_fused_add(self):
        self._inputs(8192, 7168)

    def benchmark_deepseek_v3_prefill_fused_add(self):
        self.out, _ = self.kernel.fused_add_rms_norm(self.x, self.residual, self.weight, EPS)

    def verify_deepseek_v3_prefill_fused_add(self):
        return llama_rms_norm(self.x + self.residual, self.weight)
