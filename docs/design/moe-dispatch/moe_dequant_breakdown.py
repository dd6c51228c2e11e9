"""4-bit experts at many tokens per expert (dequantize first, run 62) taken apart: where the time between the 4-bit
path and the bf16 path goes (Mixtral-8x7B T = 4096: 6797 against 5012 us in run 87, the goal 0.8x missed at 0.737).

Times by CUDA-graph replay, `experts` only (routing precomputed), int4 g128, bf16 activations:
- "dequantize": the dequantize kernels of every chunk alone (`_dequantized_columns` run through), and their bytes
  (4-bit words and scales in, bf16 out) as a share of the copy bandwidth measured in the same run;
- "4-bit": `experts` on the 4-bit experts as shipped (chunks of DEQUANT_CHUNK_BYTES);
- "4-bit, one chunk": the same with every expert in one chunk (the grouped kernels launched once);
- "4-bit, no overlap" / "4-bit, overlap": the shipped path with the other setting of DEQUANT_OVERLAP (the next
  chunk dequantized on a second stream while the grouped kernels run the last one, or everything on one stream);
- "bf16": `experts` on the same experts dequantized to bf16 beforehand (the bf16 path: its tuned table).
So 4-bit - bf16 - dequantize is what the chunking and the shared launches cost.

    PYTHONPATH=. python docs/design/moe-dispatch/moe_dequant_breakdown.py out.json [model ...]
"""
import collections
import json
import sys

import torch

from hubtools.bench import moe_dispatch as mb
from hubtools.build import loaded_kernel
from hubtools.measure import measure_copy_bandwidth, time_graph, warm_clocks
from hubtools.workspace import Workspace

T = 4096
(project,) = Workspace.load().kernels(["moe-dispatch"])
rows = []
with loaded_kernel(project) as k:
    torch.manual_seed(0)
    warm_clocks()
    bw = measure_copy_bandwidth()
    spec = mb.QUANT_FORMATS["int4-g128"]
    tk = k.ops.triton_kernels
    launch = tk.launch
    for name in sys.argv[2:] or ["mixtral-8x7b", "qwen3-30b-a3b"]:
        model = mb.MODELS[name]
        (layer,) = mb.make_quantized_layers(k, model, 1, spec)
        case = mb.QuantCase(k, model, [layer], T, "int4-g128", mb.quant_expert_bytes(k, model, spec), seed=7)
        x, (weights, ids) = case.xs[0], case.routes[0]
        out = torch.empty_like(x)
        gu16, dn16 = (k.dequantize(w, torch.bfloat16) for w in (layer.w_gate_up, layer.w_down))
        args = (model.experts, model.hidden, model.intermediate, model.top_k)
        dequant_config = {"DEQUANT": True, **tk.get_config(T, *args, torch.bfloat16, x.device)}

        def dequantize(i):  # every chunk's dequantize launches, nothing else
            parts = [(layer.w_gate_up, model.intermediate, dequant_config["gate_up"]["BLOCK_N"], True),
                     (layer.w_down, model.hidden, dequant_config["down"]["BLOCK_N"], False)]
            collections.deque(launch._dequantized_columns(parts, torch.bfloat16), maxlen=0)

        def four_bit(i):
            return tk.experts(x, layer.w_gate_up, layer.w_down, weights, ids, out, config=dequant_config)

        def bf16(i):
            return tk.experts(x, gu16, dn16, weights, ids, out)

        times = {"dequantize": time_graph(dequantize, 1, calls=5), "4-bit": time_graph(four_bit, 1, calls=5)}
        chunk_bytes = launch.DEQUANT_CHUNK_BYTES
        launch.DEQUANT_CHUNK_BYTES = 1 << 40
        try:
            times["4-bit, one chunk"] = time_graph(four_bit, 1, calls=5)
        finally:
            launch.DEQUANT_CHUNK_BYTES = chunk_bytes
        launch.DEQUANT_OVERLAP = not launch.DEQUANT_OVERLAP
        try:  # the chunks' dequantization on a second stream (overlapped with the grouped kernels), or not
            label = "4-bit, overlap" if launch.DEQUANT_OVERLAP else "4-bit, no overlap"
            times[label] = time_graph(four_bit, 1, calls=5)
        finally:
            launch.DEQUANT_OVERLAP = not launch.DEQUANT_OVERLAP
        times["bf16"] = time_graph(bf16, 1, calls=5)
        moved = sum(w.nbytes() for w in (layer.w_gate_up, layer.w_down)) + gu16.nbytes + dn16.nbytes
        row = dict(model=name, tokens=T, copy_bandwidth=bw, dequantize_bytes=moved,
                   dequantize_share_of_copy=moved / times["dequantize"] / bw, **times)
        print(f"{name} T={T}: " + ", ".join(f"{n} {t * 1e6:.0f}" for n, t in times.items())
              + f" us; dequantize at {row['dequantize_share_of_copy']:.0%} of copy", flush=True)
        rows.append(row)
        del layer, case, gu16, dn16
        torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)
