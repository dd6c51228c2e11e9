"""Whether the bench's two-mode times (70B o / 8B down at M = 1: 13.5 / 15.6 and 13.0 / 15.0 us between runs 88 and
91 on one H200, unchanged code) follow the weights' allocation or the machine.

For each shape: six fresh allocations of the rotated weights (as `hubtools.bench.w4a16` makes them), each timed
three times in a row, ours at M = 1 and cuBLAS fp16 beside it. If the slow mode follows the allocation, the three
timings of one allocation agree and the allocations split into two groups; if it follows the machine, every
timing of a stretch moves together, cuBLAS too.

    PYTHONPATH=. python docs/design/w4a16/alloc_noise_probe.py out.json
"""
import json
import sys

import torch
import torch.nn.functional as F

from hubtools.bench import w4a16 as wb
from hubtools.build import loaded_kernel
from hubtools.measure import time_graph, warm_clocks
from hubtools.workspace import Workspace

SHAPES = [s for s in wb.SHAPES if s[0] in ("L3-70B o", "L3-8B down", "L3-70B gate_up")]
rows = []
with loaded_kernel(Workspace.load().kernels(["w4a16"])[0]) as kernel:
    warm_clocks()
    for label, k, n in SHAPES:
        for allocation in range(6):
            shape = wb._Shape(kernel, k, n)
            dense = shape.dense_copies(torch.float16)
            xs = [torch.randn(1, k, device="cuda", dtype=torch.float16) for _ in range(max(shape.copies, len(dense)))]
            for repeat in range(3):
                ours = time_graph(lambda i: kernel.matmul(xs[i], shape.qws[i % shape.copies]), shape.copies)
                cublas = time_graph(lambda i: F.linear(xs[i], dense[i % len(dense)]), len(dense))
                rows.append(dict(shape=label, allocation=allocation, repeat=repeat, ours_us=ours * 1e6,
                                 cublas_us=cublas * 1e6))
                print(f"{label} allocation {allocation} repeat {repeat}: ours {ours * 1e6:.1f} us, "
                      f"cuBLAS {cublas * 1e6:.1f} us", flush=True)
            del shape, dense, xs
            torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)
