"""The Gluon kernels compiled for sm_90a on the CPU (no GPU, nothing launched): the shipped wgmma tile in every
weight format, each opt-in plan key, a split launch, and the mma GEMV with and without its cp.async ring.

The interpreter cannot run Gluon, so without this a device run is the first to compile them. A compile error, a
refusal at compile time (`wgmma._stage_bytes` refuses format flags that reached it as tensors: that mistake made
every launch wait for bytes that never arrive, docs/design/w4a16.md run 141), a spill or a serialized wgmma
pipeline (without `warp_specialize`'s PTX edit: a wait for all wgmma after each) fails here. It needs the
Triton release the kernels were built for (`tuning.GLUON_TRITON_RELEASES`; elsewhere they never run): this
Python's, or that of the Python `GLUON_COMPILE_PYTHON` names (`hubtools.sm90_compile`)."""

from pathlib import Path

import pytest

from hubtools.sm90_compile import COMPILE_PYTHON_ENV, compiler_python, run_cases

TILE = {"block_m": 128, "block_n": 256, "num_stages": 3, "inflight": 2}
CASES = {
    **{f"wgmma-{fmt}": ["wgmma", {**TILE, "split_k": 1}, fmt, 300] for fmt in ("int4", "zp", "mins", "nf4")},
    "wgmma-split-auto": ["wgmma", {**TILE, "split_k": "auto"}, "int4", 512],
    "wgmma-64x128-split3": ["wgmma", {"block_m": 64, "num_stages": 4, "split_k": 3}, "zp", 300],
    "wgmma-inflight3": ["wgmma", {**TILE, "inflight": 3}, "nf4", 300],
    "wgmma-nf4-prmt": ["wgmma", {**TILE, "split_k": 1, "nf4_smem": False}, "nf4", 300],
    "wgmma-nf4-2stages": ["wgmma", {**TILE, "num_stages": 2, "split_k": 1}, "nf4", 300],
    "wgmma-scales-loads": ["wgmma", {**TILE, "scales_tma": False}, "zp", 300],
    "wgmma-chains1": ["wgmma", {"block_m": 256, "block_n": 128, "num_stages": 2, "inflight": 2, "chains": 1},
                      "int4", 300],
    # a K-tile's two / four group rows through the ring (groups of 64 / 32), and their loads by the consumers
    "wgmma-zp-g32": ["wgmma", {**TILE, "split_k": 1}, "zp-g32", 300],
    "wgmma-scales-loads-g64": ["wgmma", {**TILE, "split_k": 1, "scales_tma": False}, "nf4", 300],
    "wgmma-chains1-g64": ["wgmma", {"block_m": 256, "block_n": 128, "num_stages": 2, "inflight": 2, "chains": 1},
                          "int4-g64", 300],
    "mma": ["mma", {"block_m": 8, "num_warps": 4}, "zp", 4],
    "mma-ring": ["mma", {"block_m": 16, "num_warps": 4, "stages": 2, "tiles": 2}, "nf4", 16],
    # the one-token GEMV (a Triton kernel) with its registers capped (E83: ptxas takes 168 for NF4 uncapped)
    "gemv-h2-nf4-maxnreg96": ["gemv_h2", {"block_n": 16, "tiles": 4, "num_warps": 2, "split_k": 1, "x_bcast": True,
                                          "tma": True, "num_stages": 3, "maxnreg": 96}, "nf4", 1],
}
GLUON_CASES = [case for case, (kind, *_) in CASES.items() if kind in ("wgmma", "mma")]


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("w4a16")


@pytest.fixture(scope="module")
def compiled(k, built_kernel_dir):
    """Each case's line from `sm90_compile.py`, run once for all of them in a process without the interpreter."""
    python = compiler_python(k.tuning.gluon_release)
    if python is None:
        pytest.skip(f"no Triton {' / '.join(k.tuning.GLUON_TRITON_RELEASES)} (the Gluon kernels' release) here: "
                    f"set {COMPILE_PYTHON_ENV} to a Python that has it")
    lines = run_cases(python, Path(__file__).with_name("sm90_compile.py"), built_kernel_dir("w4a16"),
                      list(CASES.values()))
    return dict(zip(CASES, lines))


@pytest.mark.parametrize("case", GLUON_CASES)
def test_gluon_plans_compile_for_sm90_without_spills(compiled, case):
    result = compiled[case]
    assert "error" not in result, result.get("error")
    kernel = "_wgmma_kernel" if case.startswith("wgmma") else "_mma_gemv_kernel"
    ours = [c for c in result["compiled"] if c["kernel"] == kernel]
    assert ours, result
    assert all(c["stack"] == 0 for c in ours), ours
    if kernel == "_wgmma_kernel":  # pipelined: a wait for all of a warpgroup's wgmma only at a block's end
        plan = CASES[case][1]
        consumers = plan.get("block_n", 128) // (64 * plan.get("chains", 2))
        assert all(c["wgmma"] > 0 and c["wgmma_full_waits"] == consumers for c in ours), ours


def test_register_cap_compiles_without_spills(compiled):
    """A plan's "maxnreg" reaches ptxas: the NF4 one-token GEMV at 96 registers a thread, no stack."""
    result = compiled["gemv-h2-nf4-maxnreg96"]
    assert "error" not in result, result.get("error")
    ours = [c for c in result["compiled"] if c["kernel"] == "_gemv_h2_kernel"]
    assert ours and all(c["registers"] <= 96 and c["stack"] == 0 for c in ours), result
