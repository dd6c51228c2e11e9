"""E58a A/B: moe_forward at decode T with the decode kernels as dependent launches (PDL) or not, interleaved
graphs in one process; bf16 experts for the three models, 4-bit int4 g128 where the tl.dot decode kernels run."""
import json, sys
from pathlib import Path
import kernels, torch
from hubtools.bench import moe_dispatch as mb
from hubtools.measure import rotation_count, time_graphs_interleaved, warm_clocks

k = kernels.get_local_kernel(Path(sys.argv[1]))
tk = k.ops.triton_kernels
warm_clocks()
dev = torch.device("cuda")
rows = []


def forward(case, config):
    m = case.model
    r = m.routing

    def fn(i):
        layer, x = case.layers[i], case.xs[i]
        out = torch.empty_like(x)
        return tk.moe_forward(x, layer.router, layer.w_gate_up, layer.w_down, m.top_k, r["scoring"] == "sigmoid",
                              r["renormalize"], layer.bias, r.get("num_groups", 1), r.get("topk_groups", 1),
                              r.get("scaling_factor", 1.0), None, None, out, config)
    return fn


def ab(name, label, case, config, copies):
    off = {key: ({**v, "PDL": False} if key in ("gate_up", "down") else v) for key, v in config.items()}
    on = {key: ({**v, "PDL": True} if key in ("gate_up", "down") else v) for key, v in config.items()}
    ref = forward(case, off)(0).float()
    got = forward(case, on)(0).float()
    assert torch.equal(ref, got), f"{name} {label}: PDL changed the result"
    t_on, t_off = time_graphs_interleaved([forward(case, on), forward(case, off)], copies, rounds=7)
    on_us, off_us = min(t_on) * 1e6, min(t_off) * 1e6
    print(f"{name} {label}: PDL {on_us:.1f} us, without {off_us:.1f} us, speed-up {off_us / on_us:.3f}", flush=True)
    rows.append(dict(model=name, case=label, pdl=t_on, no_pdl=t_off))


for name, m in mb.MODELS.items():
    copies = rotation_count(m.top_k * m.expert_bytes(), max_copies=8)
    layers = mb.make_layers(m, copies)
    for T in (1, 4, 16):
        case = mb.Case(k, m, layers, T, skewed=False, seed=T)
        ab(name, f"bf16 T={T}", case, tk.get_config(T, m.experts, m.hidden, m.intermediate, m.top_k, torch.bfloat16, dev), copies)
    del layers, case
    torch.cuda.empty_cache()
spec = mb.QUANT_FORMATS["int4-g128"]
m = mb.MODELS["mixtral-8x7b"]
eb = mb.quant_expert_bytes(k, m, spec)
copies = rotation_count(m.top_k * eb, max_copies=16)
layers = mb.make_quantized_layers(k, m, copies, spec)
for T in (8, 16):
    case = mb.QuantCase(k, m, layers, T, "int4-g128", eb, seed=T)
    config = tk.default_config(T, m.experts, m.hidden, m.intermediate, m.top_k, dev, quantized=True,
                               packed=tk.packed_gemv(layers[0].w_down, torch.bfloat16))
    if config.get("GEMV"):
        continue
    ab("mixtral-8x7b", f"4bit T={T}", case, config, copies)
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[2], "w"), indent=1)
