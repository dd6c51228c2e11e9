"""`kernels benchmark` workloads for w4a16: Llama-3-8B linear layers, int4 group 128 (and NF4), fp16.

The runner times each call with a host clock (launch overhead included) and checks `self.out` against
the `verify_*` reference (the same weight dequantized, then `F.linear`) with atol=1e-2. CUDA-graph timings
against cuBLAS and `aten._weight_int4pack_mm` are in docs/benchmarks/w4a16.md (`python scripts/bench.py w4a16`).
"""

import torch
import torch.nn.functional as F
from kernels import Benchmark


class W4A16Benchmark(Benchmark):
    seed = 0

    def _inputs(self, n, k, m, fmt="int4"):
        dtype = torch.float16
        weight = torch.randn(n, k, device=self.device, dtype=dtype) * 0.02
        self.qweight = self.kernel.quantize(weight, group_size=128, fmt=fmt)
        self.dense = self.kernel.dequantize(self.qweight)
        self.x = torch.randn(m, k, device=self.device, dtype=dtype)

    def _reference(self):
        return F.linear(self.x.float(), self.dense.float()).to(self.x.dtype)

    # Decode: one token through the fused qkv projection (4096 -> 6144).
    def setup_llama8b_qkv_decode(self):
        self._inputs(6144, 4096, 1)

    def benchmark_llama8b_qkv_decode(self):
        self.out = self.kernel.matmul(self.x, self.qweight)

    def verify_llama8b_qkv_decode(self):
        return self._reference()

    # Batched decode: 16 tokens through the down projection (14336 -> 4096).
    def setup_llama8b_down_batch16(self):
        self._inputs(4096, 14336, 16)

    def benchmark_llama8b_down_batch16(self):
        self.out = self.kernel.matmul(self.x, self.qweight)

    def verify_llama8b_down_batch16(self):
        return self._reference()

    # Prefill: 1024 tokens through the gate/up projection (4096 -> 28672).
    def setup_llama8b_gate_up_prefill(self):
        self._inputs(28672, 4096, 1024)

    def benchmark_llama8b_gate_up_prefill(self):
        self.out = self.kernel.matmul(self.x, self.qweight)

    def verify_llama8b_gate_up_prefill(self):
        return self._reference()

    # NF4 decode through the output projection (4096 -> 4096).
    def setup_llama8b_o_nf4_decode(self):
        self._inputs(4096, 4096, 1, fmt="nf4")

    def benchmark_llama8b_o_nf4_decode(self):
        self.out = self.kernel.matmul(self.x, self.qweight)

    def verify_llama8b_o_nf4_decode(self):
        return self._reference()
