"""moe_forward at T = 1 and 4 (4-bit int4 g128 experts) with the router GEMV's split width varied."""
import importlib, json, sys
import torch
from hubtools.build import loaded_kernel
from hubtools.workspace import Workspace
from hubtools.bench import moe_dispatch as mb
from hubtools.measure import time_graph, rotation_count, warm_clocks

(project,) = Workspace.load().kernels(["moe-dispatch"])
rows = []
with loaded_kernel(project) as k:
    launch = importlib.import_module(k.__name__ + ".triton_kernels.launch")
    warm_clocks()
    spec = mb.QUANT_FORMATS["int4-g128"]
    for name, model in mb.MODELS.items():
        eb = mb.quant_expert_bytes(k, model, spec)
        copies = rotation_count(model.top_k * eb, max_copies=16)
        layers = mb.make_quantized_layers(k, model, copies, spec)
        for T in (1, 2, 4):
            case = mb.QuantCase(k, model, layers, T, "int4-g128", eb, seed=100)
            res = {}
            for split in ("gemv", "cuBLAS"):
                if split == "cuBLAS":
                    launch.ROUTER_GEMV_MAX_TOKENS = 0
                else:
                    launch.ROUTER_GEMV_MAX_TOKENS = 4
                res[str(split)] = time_graph(case.ours, copies, calls=max(40, 2 * copies))
            launch.ROUTER_GEMV_MAX_TOKENS = 4
            print(f"{name} T={T} moe_forward: " + ", ".join(f"{n} {t * 1e6:.1f}" for n, t in res.items()) + " us",
                  flush=True)
            rows.append(dict(model=name, tokens=T, **res))
        del layers
        torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)
