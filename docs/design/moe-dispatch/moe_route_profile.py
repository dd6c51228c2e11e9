"""Kernel durations of the decode routing (router GEMV + routing kernel) at T = 1, 2, 4, eager, by torch.profiler."""
import torch
from hubtools.build import loaded_kernel
from hubtools.workspace import Workspace
from hubtools.bench import moe_dispatch as mb

(project,) = Workspace.load().kernels(["moe-dispatch"])
with loaded_kernel(project) as k:
    tk = k.ops.triton_kernels
    for name, model in mb.MODELS.items():
        r = model.routing
        router = torch.randn(model.experts, model.hidden, device="cuda").bfloat16()
        bias = torch.randn(model.experts, device="cuda") * 0.01 if r["scoring"] == "sigmoid" else None
        args = (model.top_k, r["scoring"] == "sigmoid", r["renormalize"], bias, r.get("num_groups", 1),
                r.get("topk_groups", 1), r.get("scaling_factor", 1.0))
        for T in (1, 2, 4):
            x = torch.randn(T, model.hidden, device="cuda").bfloat16()
            for _ in range(3):
                tk.route(None, *args, hidden_states=x, router_weight=router)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    tk.route(None, *args, hidden_states=x, router_weight=router)
                torch.cuda.synchronize()
            times = {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.device_time_total > 0}
            print(f"{name} T={T} kernel us: " + ", ".join(f"{n} {t:.2f}" for n, t in times.items()), flush=True)
