"""Sustained clocks and power: each of (ours, cuBLAS) per shape replayed back to back for SECONDS while nvidia-smi
samples every 20 ms; prints per phase the median SM clock, power and us per call (first 0.3 s dropped).
python .run/power.py OUT_JSON SECONDS 'label:M' ..."""
import json, statistics, subprocess, sys, time
import torch
from hubtools.workspace import Workspace
from hubtools.build import loaded_kernel
from hubtools.bench.w4a16 import SHAPES, QWEN_SHAPES, OTHER_SHAPES, _Shape, _inputs
from hubtools.measure import _captured, warm_clocks

out, seconds, cases = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
every = {s[0]: s for s in SHAPES + QWEN_SHAPES + OTHER_SHAPES}
smi = open(out + ".smi", "w")
log = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
                        "--format=csv,noheader,nounits", "-lms", "20"], stdout=smi, text=True)
phases = []
with loaded_kernel(Workspace.load().kernel("w4a16")) as k:
    warm_clocks()
    for case in cases:
        label, m = case.rsplit(":", 1); m = int(m)
        _, kk, n = every[label]
        shape = _Shape(k, kk, n)
        cfg = dict(k.tuning.select(m, n, kk, torch.device("cuda")))
        dense = shape.dense_copies(torch.float16)
        xs = _inputs(m, kk, torch.float16, max(shape.copies, len(dense)))
        fns = {"ours": lambda i: k.triton_kernels.matmul(xs[i], shape.qws[i % shape.copies].qweight, shape.qws[i % shape.copies].scales, None, None, None, n, kk, 128, cfg),
               "cublas": lambda i: torch.nn.functional.linear(xs[i], dense[i % len(dense)])}
        for name, fn in fns.items():
            calls = 20
            g = _captured(fn, len(xs), calls)
            time.sleep(1.0)  # idle between phases: each starts from the same cool state
            t0 = time.time(); reps = []
            while time.time() - t0 < seconds:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); g.replay(); e.record(); e.synchronize()
                reps.append((time.time() - t0, s.elapsed_time(e) * 1e3 / calls))
            phases.append({"case": case, "impl": name, "start": t0, "end": time.time(), "reps": reps, "config": cfg if name == "ours" else None})
            del g
        del shape, dense, xs
        torch.cuda.empty_cache()
log.terminate(); log.wait(); smi.close()
samples = []
for line in open(out + ".smi").read().splitlines():
    try:
        ts, sm, pw, reason = [v.strip() for v in line.split(",")]
        t = time.mktime(time.strptime(ts.split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + ts.split(".")[1])
        samples.append((t, int(sm), float(pw), reason))
    except ValueError:
        pass
for p in phases:
    inside = [s for s in samples if p["start"] + 0.3 <= s[0] <= p["end"]]
    steady = [us for t, us in p["reps"] if t >= 0.3]
    p["summary"] = {"sm_mhz": statistics.median(s[1] for s in inside) if inside else None,
                    "power_w": statistics.median(s[2] for s in inside) if inside else None,
                    "us_first": p["reps"][0][1], "us_steady": statistics.median(steady) if steady else None,
                    "samples": len(inside)}
    print(p["case"], p["impl"], p["summary"])
json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": seconds, "phases": phases, "samples": samples}, open(out, "w"))
