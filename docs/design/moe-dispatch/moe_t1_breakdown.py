"""moe_forward at T = 1 with 4-bit int4 g128 experts, taken apart: the router GEMM, the routing kernel, both,
the experts (fused_experts on precomputed routing) and the whole layer; CUDA-graph replay over rotated copies."""
import json, sys
import torch
import torch.nn.functional as F
from hubtools.build import loaded_kernel
from hubtools.workspace import Workspace
from hubtools.bench import moe_dispatch as mb
from hubtools.measure import time_graph, rotation_count, warm_clocks, measure_copy_bandwidth

(project,) = Workspace.load().kernels(["moe-dispatch"])
rows = []
with loaded_kernel(project) as k:
    torch.manual_seed(0)
    warm_clocks()
    bw = measure_copy_bandwidth()
    spec = mb.QUANT_FORMATS["int4-g128"]
    for name, model in mb.MODELS.items():
        eb = mb.quant_expert_bytes(k, model, spec)
        copies = rotation_count(model.top_k * eb, max_copies=16)
        layers = mb.make_quantized_layers(k, model, copies, spec)
        for T in (1, 4):
            case = mb.QuantCase(k, model, layers, T, "int4-g128", eb, seed=100)
            logits = [F.linear(x, l.router) for x, l in zip(case.xs, layers)]

            def linear(i):
                return F.linear(case.xs[i], layers[i].router)

            def routing(i):
                return k.route(logits[i], model.top_k, correction_bias=layers[i].bias, **model.routing)

            def both(i):
                return k.route(F.linear(case.xs[i], layers[i].router), model.top_k, correction_bias=layers[i].bias,
                               **model.routing)

            r = model.routing
            tk = k.ops.triton_kernels

            def gemv_route(i):
                args = (model.top_k, r["scoring"] == "sigmoid", r["renormalize"], layers[i].bias,
                        r.get("num_groups", 1), r.get("topk_groups", 1), r.get("scaling_factor", 1.0))
                return tk.route(None, *args, hidden_states=case.xs[i], router_weight=layers[i].router)

            def experts(i):
                w, ids = case.routes[i]
                return k.fused_experts(case.xs[i], layers[i].w_gate_up, layers[i].w_down, w, ids)

            times = {n: time_graph(f, copies, calls=max(40, 2 * copies)) for n, f in
                     (("linear", linear), ("route", routing), ("linear+route", both), ("router_gemv+route", gemv_route), ("experts", experts),
                      ("moe_forward", case.ours))}
            bound = case.weight_bytes() / bw
            print(f"{name} T={T}: " + ", ".join(f"{n} {t * 1e6:.1f}" for n, t in times.items())
                  + f" us; bound {bound * 1e6:.1f} us", flush=True)
            rows.append(dict(model=name, tokens=T, bound=bound, **times))
        del layers
        torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, rows=rows), open(sys.argv[1], "w"), indent=1)

