"""Run 37 probe (not shipped): the mma GEMV with x's fragment loads replaced by a constant, or the dequantization
replaced by a bit cast, timed beside the unmodified kernel and the shipped GEMV at one token."""
import sys, types, json, os, re
sys.path.insert(0, "w4a16/torch-ext")
ops_stub = types.ModuleType("w4a16._ops"); ops_stub.add_op_namespace_prefix = lambda n: "w4a16_probe::" + n
sys.modules["w4a16._ops"] = ops_stub
import torch, triton
import w4a16
from w4a16 import tuning
from w4a16.triton_kernels import launch
src = open("w4a16/torch-ext/w4a16/triton_kernels/mma.py").read()
probes = {
    "nox": src.replace("xj = gl.load(x_ptrs + k_off, mask=m_ok & live, other=0.0)",
                       "xj = gl.full([16, x_ptrs.type.shape[1]], 0.01, dtype, layout=x_ptrs.type.layout)"),
    "nodeq": src.replace("a0, a1, a2, a3, a4, a5, a6, a7 = _dequant_tile(words, c0, c1, c2, c3, c4, c5, c6, c7)",
                         "a0 = (words & 0x3C00).to(gl.int16).to(dtype, bitcast=True)\n    a1 = a0; a2 = a0; a3 = a0; a4 = a0; a5 = a0; a6 = a0; a7 = a0"),
}
mods = {}
for name, text in probes.items():
    assert text != src, name
    path = f"w4a16/torch-ext/w4a16/triton_kernels/mma_{name}.py"
    open(path, "w").write(text)
    mods[name] = __import__(f"w4a16.triton_kernels.mma_{name}", fromlist=["x"])
from w4a16.triton_kernels import mma as base
mods["base"] = base
res = {}
shapes = {"L3-70B gate_up": (57344, 8192), "L3-70B down": (8192, 28672), "L3-8B gate_up": (28672, 4096)}
for label, (n, k) in shapes.items():
    copies = 3
    qws = [w4a16.quantize(torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.05, group_size=128, zero_point=True) for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    out = torch.empty(1, n, device="cuda", dtype=torch.float16)
    def timed(fn):
        for i in range(5): fn(qws[i % copies])
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(30): fn(qws[i % copies])
        g.replay(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); [g.replay() for _ in range(5)]; e.record(); torch.cuda.synchronize()
        return s.elapsed_time(e) / 150 * 1e3
    shipped = tuning.select(1, n, k, x.device)
    res[(label, "gemv")] = timed(lambda q: launch.matmul(x, q.qweight, q.scales, q.zeros, None, None, n, k, 128, shipped, out=out))
    for name, mod in mods.items():
        for plan in ({"num_warps": 4, "tiles": 8}, {"num_warps": 4, "tiles": 8, "split_k": 2}, {"num_warps": 4, "tiles": 4}):
            def run(q, mod=mod, plan=plan):
                splits = plan.get("split_k", 1); nt = q.qweight.shape[1] // 16; per = triton.cdiv(nt, splits)
                tgt = out if splits == 1 else torch.empty(splits, 1, n, device="cuda")
                mod._mma_gemv_kernel[(1, q.qweight.shape[0] // 64, splits)](
                    x, q.qweight, q.scales, q.zeros, q.scales, tgt, 1, n, k, nt, per, x.stride(0), q.qweight.stride(0),
                    q.scales.stride(0), tgt.stride(-2), tgt.stride(0), GROUP=128, PER_CHANNEL=False, HAS_ZERO=True,
                    HAS_BIAS=False, PARTIAL=splits > 1, BLOCK_M=8, REPS=1, TILES=plan["tiles"], MASK_K=False, num_warps=4)
            try:
                res[(label, name, json.dumps(plan))] = timed(run)
            except Exception as exc:
                print(label, name, plan, "FAILED", str(exc)[:300])
    del qws
for key, us in res.items():
    print(" | ".join(key), f"{us:.1f} us")
json.dump({" | ".join(k): v for k, v in res.items()}, open(os.environ.get("OUT", ".") + "/run37-probe.json", "w"), indent=1)
