"""An edit of the PTX Triton 3.6 makes for warp-specialized kernels, applied at compile time to one kernel.

w4a16 and moe-dispatch each carry this file (standalone Hub packages import nothing of each other); the copies are
the same bytes, which tests/test_moe_dispatch_quantized.py checks.

Triton 3.6 lowers `gl.warp_specialize` to a loop in which the worker warps wait for a partition index and jump to
their code through a table, then wait again. Inside that loop ptxas gives a worker's code only the kernel's launch
register budget and serializes every wgmma of the function (C7512 / C7515), so a dequantizing warpgroup in a
worker partition made w4a16's `wgmma._wgmma_kernel` slower, not faster (docs/design/w4a16.md E39, E40). A kernel
that specializes once (the second index a worker waits for is always "exit") runs the same program with the loop
opened: each branch back to the loop's header goes to the exit instead.
"""

from __future__ import annotations

import contextlib
import re
import warnings

from triton import knobs

_LOOP_HEADER = re.compile(r"^(\$L__BB\d+_\d+):[^\n]*\n\s*// =>This Loop Header: Depth=1$", re.M)


def unloop_worker_dispatch(ptx: str) -> str:
    """`ptx` with Triton's worker dispatch loop opened: each branch back to the loop's header goes to an exit
    block that does what the header does before it reads "exit" (one barrier), then returns. PTX of another shape
    (no dispatch table, no loop header before it, no branch into the loop from outside it) is returned as it is."""
    brx = ptx.find("brx.idx")
    headers = [m for m in _LOOP_HEADER.finditer(ptx, 0, brx if brx >= 0 else 0)]
    if brx < 0 or not headers:
        return ptx
    header = headers[-1].group(1)
    back = f"\tbra.uni \t{header};"
    entry = ptx.find(back)
    if entry < 0 or entry > headers[-1].start() or ptx.count(back) < 2 or "$L__ws_exit" in ptx:
        return ptx
    # the first branch to the header must be the entry, from a block outside the loop (LLVM marks loop blocks)
    block_label = ptx[ptx.rfind("\n$L__BB", 0, entry) + 1:]
    if "in Loop" in block_label[:block_label.find("\n")]:
        return ptx
    head, tail = ptx[:entry + len(back)], ptx[entry + len(back):]
    tail = tail.replace(back, "\tbra.uni \t$L__ws_exit;")
    exit_block = "$L__ws_exit:\n\tbarrier.sync \t1;\n\tret;\n"
    return head + "\n" + exit_block + tail


def _unlooped_ptx(ptx: str, kernel: str) -> str:
    if f".entry {kernel}(" not in ptx:  # another kernel compiled meanwhile (another thread): not ours to edit
        return ptx
    edited = unloop_worker_dispatch(ptx)
    if edited is ptx:
        warnings.warn(f"this Triton's warp-specialized PTX of {kernel} is not the shape "
                      "unloop_worker_dispatch knows (Triton 3.6's); its worker partitions' wgmma run serialized "
                      "(slower, still exact)", stacklevel=2)
    return edited


@contextlib.contextmanager
def unlooped_workers(kernel: str):
    """Compiles of the kernel named `kernel` within this block get `unloop_worker_dispatch`, through Triton's
    stage hook (`knobs.runtime.add_stages_inspection_hook`, wrapping the PTX stage; restored after, and a hook
    set by someone else still runs first). Launches of an already compiled kernel only pay the attribute swap."""
    previous = knobs.runtime.add_stages_inspection_hook

    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        make_ptx = stages["ptx"]
        stages["ptx"] = lambda src, metadata: _unlooped_ptx(make_ptx(src, metadata), kernel)

    knobs.runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = previous
