"""Triton kernels of the fused MoE layer and their launchers.

Launches for a whole layer (`moe_forward`), none of them sized by device data (no host syncs):

- T <= DECODE_MAX_TOKENS (decode): router logits (`_router_gemv_kernel` up to ROUTER_GEMV_MAX_TOKENS tokens, else
  cuBLAS) -> `_route_kernel` -> `_gate_up_decode_kernel`
  -> `_down_decode_kernel` -> `_combine_kernel`. No sort: each program takes one (token, slot) pair and
  works only if that pair is the first to name its expert, so every selected expert's weights are
  streamed once, by many programs at a time. One token on 16-bit experts with a config's "STREAM" (the
  heuristic's for intermediate sizes <= STREAM_MAX_INTERMEDIATE): `_gate_up_stream_kernel` ->
  `_down_stream_kernel` instead, each GEMV's (pair, row block) items split over a few programs per SM that
  stream them through one pipelined loop.
- larger T: `_route_kernel` (router GEMM fused, also writes a per-chunk expert histogram) -> `_align_kernel`
  (pairs sorted by expert, each expert padded to BLOCK_M) -> `_gate_up_grouped_kernel` (gathers token rows
  on load, SiLU(gate) * up epilogue) -> `_down_grouped_kernel` (routing weight applied in fp32) ->
  `_combine_kernel` (sum over the top-k slots in slot order: deterministic, no atomics).

`fused_experts` with caller-given ids runs `_histogram_kernel` in place of the router.

4-bit experts (`QuantizedExperts`, quantized.py) run the same launches: the four expert kernels take
QUANT=True and the format as constexprs (NF4, HAS_ZERO, HAS_MIN, GROUP); their K loops then step one packed
tile (128 columns, 16 words per row) at a time and dequantize it in registers (`_dequant_tile`) into the
operand of the same tl.dot. At a few tokens GEMVs replace the two decode kernels (no tensor cores; one program
per (token, slot) pair and block of rows): `_gate_up_h2_kernel` / `_down_h2_kernel` (packed-fp16 arithmetic,
TMA rings; int4 in groups of >= 128 columns or per channel, 16-bit activations, T <= PACKED_GEMV_MAX_TOKENS),
else `_gate_up_gemv_kernel` / `_down_gemv_kernel` (fp32, T <= GEMV_MAX_TOKENS); a gate/up plan's "MMA" takes
`mma._gate_up_mma_kernel` instead (tensor cores: w4a16's mma GEMV loop, `mma_gemv`, byte for byte); a down GEMV
split over K leaves fp32 partial sums that the combine adds. From DEQUANT_MIN_PAIRS (token, slot) pairs per expert the
experts are instead dequantized once (`_dequantize_kernel`, chunks of columns of every expert into a reused
16-bit buffer) and the grouped kernels run as for 16-bit experts, one launch per chunk over that chunk's
columns. On Hopper with the Triton release it was built for, int4 experts from `launch.wgmma_min_pairs` pairs per
expert run neither: `_gather_rows_kernel` (the token rows in sorted order, for TMA, and each pair's sorted row), then
the Gluon kernel `wgmma._grouped_wgmma_kernel` twice (gate / up with its SwiGLU epilogue, then down, its weighted
rows stored by TMA in sorted order for the combine; dequantization overlapped with asynchronous wgmma;
`wgmma_chunks` and `warp_specialize` are w4a16's modules byte for byte). No shared expert rides along with 4-bit
experts (the op adds a dense one after).

Buffers are sized by upper bounds known from shapes: the padded pair count is at most
(T*k // BLOCK_M + min(E, T*k)) * BLOCK_M <= T*k + E*(BLOCK_M-1). A shared expert of the routed experts'
intermediate size rides along as expert E in an extra top-k slot of weight 1.
"""

from .configs import (CHUNK_TOKENS, DECODE_MAX_TOKENS, DEQUANT_MIN_PAIRS, GEMV_MAX_TOKENS, PACKED_GEMV_MAX_TOKENS,
                      ROUTER_GEMV_MAX_TOKENS, config_path, default_config, get_config)
from .launch import experts, moe_forward, packed_gemv, route

__all__ = ["CHUNK_TOKENS", "DECODE_MAX_TOKENS", "DEQUANT_MIN_PAIRS", "GEMV_MAX_TOKENS", "PACKED_GEMV_MAX_TOKENS",
           "ROUTER_GEMV_MAX_TOKENS", "config_path", "default_config", "experts", "get_config", "moe_forward",
           "packed_gemv", "route"]
