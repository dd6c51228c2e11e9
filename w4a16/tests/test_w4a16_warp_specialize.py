"""`triton_kernels.warp_specialize`: the edit of Triton 3.6's warp-specialized PTX that opens the worker dispatch
loop (the GPU tests run the edited two-consumer wgmma kernel; these check the edit itself on the CPU)."""

import importlib

import pytest

# The shape of Triton 3.6's lowering, cut down: the entry jumps from the preheader into the loop; each case of the
# dispatch table ends by branching back to the header; the default partition's own code returns at the top.
DISPATCH = """\
.visible .entry k(
)
{
\tsetp.lt.u32 \t%p1, %r3, 4;
\t@%p1 bra \t$L__BB0_9;
\tbra.uni \t$L__BB0_1;
$L__BB0_9:
\tbarrier.sync \t1;
\tret;
$L__BB0_1:                              // %.preheader.preheader
\tbra.uni \t$L__BB0_2;
$L__BB0_4:                              //   in Loop: Header=BB0_2 Depth=1
\tbarrier.sync \t1;
\tbra.uni \t$L__BB0_2;
$L__BB0_2:                              // %.preheader
                                        // =>This Loop Header: Depth=1
\tbarrier.sync \t1;
\tld.shared.b8 \t%r34, [%r36+139380];
\t$L_brx_0: .branchtargets
\t\t$L__BB0_5,
\t\t$L__BB0_4,
\t\t$L__BB0_8;
\tbrx.idx \t%r34, $L_brx_0;
$L__BB0_5:                              //   in Loop: Header=BB0_2 Depth=1
\twgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%r1}, {%r2}, %rd3, 1, 1, 1, 1;
\tbarrier.sync \t1;
\tbra.uni \t$L__BB0_2;
$L__BB0_8:
\tret;
}
"""


@pytest.fixture
def ws(load_kernel):
    k = load_kernel("w4a16")
    return importlib.import_module(f"{k.__name__}.triton_kernels.warp_specialize")


def test_unloop_sends_every_back_edge_to_one_exit(ws):
    """The entry into the loop stays; every other branch to the header goes to an exit block (the header's
    barrier, then ret) placed where nothing falls into it; the rest of the text is unchanged."""
    edited = ws.unloop_worker_dispatch(DISPATCH)
    assert edited.count("bra.uni \t$L__BB0_2;") == 1
    assert edited.index("bra.uni \t$L__BB0_2;") < edited.index("$L__BB0_4:")
    assert edited.count("bra.uni \t$L__ws_exit;") == 2
    assert edited.count("$L__ws_exit:\n\tbarrier.sync \t1;\n\tret;\n") == 1
    assert edited.index("$L__ws_exit:") < edited.index("$L__BB0_4:")
    assert edited.replace("$L__ws_exit:\n\tbarrier.sync \t1;\n\tret;\n", "").replace("\n\n", "\n").replace(
        "$L__ws_exit;", "$L__BB0_2;") == DISPATCH


@pytest.mark.parametrize("ptx", [DISPATCH.replace("brx.idx", "// no table"),
                                 DISPATCH.replace("=>This Loop Header", "a comment"),
                                 DISPATCH.replace("\tbra.uni \t$L__BB0_2;\n$L__BB0_4", "\tret;\n$L__BB0_4", 1)],
                         ids=["no-dispatch-table", "no-loop-header", "no-entry-into-the-loop"])
def test_unloop_leaves_other_shapes_as_they_are(ws, ptx):
    assert ws.unloop_worker_dispatch(ptx) is ptx


def test_unloop_is_applied_once(ws):
    edited = ws.unloop_worker_dispatch(DISPATCH)
    assert ws.unloop_worker_dispatch(edited) is edited


def test_unlooped_workers_edits_only_the_named_kernel_and_restores_the_hook(ws):
    """Inside the block Triton's stage hook wraps the PTX stage (after a hook that was set already, which still
    runs); the edit applies to the named kernel's PTX only, a kernel of that name whose PTX it cannot edit warns;
    after the block the previous hook is back."""
    knobs = ws.knobs.runtime
    seen = []
    previous = knobs.add_stages_inspection_hook
    try:
        knobs.add_stages_inspection_hook = lambda *args: seen.append(args)
        outer = knobs.add_stages_inspection_hook
        with ws.unlooped_workers("k"):
            stages = {"ptx": lambda src, metadata: src}
            knobs.add_stages_inspection_hook(None, stages, None, None, 90)
            assert len(seen) == 1
            assert "$L__ws_exit" in stages["ptx"](DISPATCH, {})
            other = DISPATCH.replace(".entry k(", ".entry other(")
            assert stages["ptx"](other, {}) is other
            with pytest.warns(UserWarning, match="serialized"):
                flat = DISPATCH.replace("brx.idx", "// no table")
                assert stages["ptx"](flat, {}) is flat
        assert knobs.add_stages_inspection_hook is outer
    finally:
        knobs.add_stages_inspection_hook = previous
