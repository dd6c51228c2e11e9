"""moe-dispatch's Gluon grouped kernel for 4-bit experts compiled for sm_90a on the CPU (no GPU, nothing launched):
the default plan in each int4 format and activation dtype, and the other ring depths and token tiles.

The interpreter cannot run Gluon, so without this a device run is the first to compile it. A compile error, a
spill or a serialized wgmma pipeline fails here (without `warp_specialize`'s PTX edit ptxas serializes every wgmma
of the kernel: a wait for all of them after each). It needs the Triton release
the kernel was built for (`launch.GLUON_TRITON_RELEASES`): this Python's, or that of the Python
`GLUON_COMPILE_PYTHON` names (`hubtools.sm90_compile`)."""

from pathlib import Path

import pytest

from hubtools.sm90_compile import COMPILE_PYTHON_ENV, compiler_python, run_cases

CASES = {  # [fmt, group_size, dtype, BLOCK_M, num_stages]
    "int4-g128-bf16": ["int4", 128, "bfloat16", 128, 3],
    "zp-g32-fp16": ["zp", 32, "float16", 128, 3],
    "mins-g64-bf16": ["mins", 64, "bfloat16", 128, 3],
    "zp-channel-bf16": ["zp", -1, "bfloat16", 128, 3],
    "int4-g128-fp16-m64-s4": ["int4", 128, "float16", 64, 4],
    "zp-g128-bf16-s2": ["zp", 128, "bfloat16", 128, 2],
    "int4-g128-bf16-s4": ["int4", 128, "bfloat16", 128, 4],  # the down GEMM: 3 stages beside its output tiles
}
MMA_CASES = {  # ["mma", fmt, group_size, dtype, plan]: the tensor-core GEMVs
    "mma-int4-g128-bf16": ["mma", "int4", 128, "bfloat16", {"num_warps": 4, "TILES": 4, "num_stages": 2}],
    "mma-zp-g32-fp16": ["mma", "zp", 32, "float16", {"num_warps": 2, "TILES": 8, "num_stages": 3}],
    "mma-zp-channel-bf16": ["mma", "zp", -1, "bfloat16", {"num_warps": 1, "TILES": 2, "num_stages": 4}],
    "mma-int4-g256-fp16": ["mma", "int4", 256, "float16", {"num_warps": 4, "TILES": 2, "num_stages": 3}],
    # the gate/up GEMV zeroing the packed down GEMV's fold counts
    "mma-int4-g128-bf16-fold": ["mma", "int4", 128, "bfloat16", {"num_warps": 2, "TILES": 4, "num_stages": 3,
                                                                  "FOLD_COMBINE": True}],
}


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("moe-dispatch")


@pytest.fixture(scope="module")
def compiled(k, built_kernel_dir):
    """Each case's line from `moe_dispatch_sm90_compile.py`, run once for all of them in a process without the
    interpreter."""
    launch = k.ops.triton_kernels.launch
    python = compiler_python(launch.gluon_release)
    if python is None:
        pytest.skip(f"no Triton {' / '.join(launch.GLUON_TRITON_RELEASES)} (the Gluon kernel's release) here: "
                    f"set {COMPILE_PYTHON_ENV} to a Python that has it")
    lines = run_cases(python, Path(__file__).with_name("moe_dispatch_sm90_compile.py"),
                      built_kernel_dir("moe-dispatch"), list(CASES.values()) + list(MMA_CASES.values()))
    return dict(zip(list(CASES) + list(MMA_CASES), lines))


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_wgmma_compiles_for_sm90_without_spills(compiled, case):
    """Both GEMMs (the SwiGLU gate / up and the scattering down kernel) and the row gather compile, without a
    stack frame."""
    result = compiled[case]
    assert "error" not in result, result.get("error")
    names = [c["kernel"] for c in result["compiled"]]
    assert names == ["_gather_rows_kernel", "_grouped_wgmma_kernel", "_grouped_wgmma_kernel"], result
    assert all(c["stack"] == 0 for c in result["compiled"]), result
    for kernel in result["compiled"][1:]:  # two warpgroups of 2 chains x 8 chunks; a full wait only after a block
        assert kernel["wgmma"] == 32 and kernel["wgmma_full_waits"] == 2, kernel
        assert kernel["shared"] <= 232448, kernel  # what an H100 / H200 CTA can have


@pytest.mark.parametrize("case", list(MMA_CASES))
def test_mma_gemvs_compile_for_sm90_without_spills(compiled, case):
    """The tensor-core gate/up and down GEMVs compile in each plan without a stack frame, within a CTA's shared
    memory."""
    result = compiled[case]
    assert "error" not in result, result.get("error")
    assert [kernel["kernel"] for kernel in result["compiled"]] == ["_gate_up_mma_kernel", "_down_mma_kernel"], result
    for kernel in result["compiled"]:
        assert kernel["stack"] == 0 and kernel["shared"] <= 232448, kernel
