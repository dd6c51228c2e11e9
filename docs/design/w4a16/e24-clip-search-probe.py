"""Prototype: MSE clip search for group parameters, on Gemma-3-270M perplexity (RTN and GPTQ)."""
import sys, time, copy, tempfile, json
from pathlib import Path
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/examples")
import torch
torch.set_num_threads(2)
import gemma3 as ex
from hubtools.build import build_kernel, load_build
from hubtools.workspace import Workspace
from hubtools.e2e.quality import calibration_batches, load_text, perplexity

variants = sys.argv[1:]
model, tok, path, _ = ex.load_gemma3()
ids = load_text(tok, 1024)
with tempfile.TemporaryDirectory() as d:
    w4 = load_build(build_kernel(Workspace.load(Path("/work/main")).kernel("w4a16"), Path(d)))
    F = w4.formats
    plain = F.group_params

    def searched(w, *, fmt, zero_point, dtype, grid=torch.linspace(1.0, 0.70, 16)):
        best_s, best_z = plain(w, fmt=fmt, zero_point=zero_point, dtype=dtype)
        def err(s, z):
            sb = s.unsqueeze(-1); zb = None if z is None else z.unsqueeze(-1)
            return (w - F.decode(F.encode(w, sb, zb, fmt=fmt), sb, zb, fmt=fmt)).pow(2).sum(-1)
        best_e = err(best_s, best_z)
        for p in grid[1:]:
            s, z = plain(w * p, fmt=fmt, zero_point=zero_point, dtype=dtype)  # range shrunk by p
            e = err(s, z)
            better = e < best_e
            best_e = torch.where(better, e, best_e)
            best_s = torch.where(better, s, best_s)
            if z is not None:
                best_z = torch.where(better, z, best_z)
        return best_s, best_z

    calib = None
    for name in variants:
        clip = name.endswith("-clip")
        F.group_params = searched if clip else plain
        w4.gptq.group_params = F.group_params
        base = name.removesuffix("-clip")
        m = copy.deepcopy(model)
        t = time.time()
        if base != "unquantized":
            spec = ex.VARIANTS[base]
            if spec.get("gptq") and calib is None:
                calib = calibration_batches(copy.deepcopy(model).to(torch.float32), tok, "cpu", **ex.CALIBRATION)
            from hubtools.e2e.quality import quantize
            quantize(m, w4, spec["fmt"], spec["group_size"], spec["zero_point"], calib if spec.get("gptq") else None,
                     act_order=spec.get("act_order", False))
        ppl = perplexity(m, ids, 512, 512, bos_token_id=tok.bos_token_id)
        print(json.dumps({"variant": name, "ppl": round(ppl, 4), "s": round(time.time() - t, 1)}), flush=True)
