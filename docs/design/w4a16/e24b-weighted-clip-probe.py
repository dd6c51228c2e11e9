"""E24b probe (docs/design/w4a16.md): the clip search of e24-clip-search-probe.py with each group's squared error
weighted by the layer's Hessian diagonal (its inputs' second moments), inside w4a16's GPTQ with act-order, on
Gemma-3-270M. Not part of the package: the search replaces `gptq.group_params` for the duration of each
`gptq_quantize` call, which hands it the groups in column order (128-column blocks, so group g is columns
128 g ... in the act-order permutation)."""
import copy, json, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3])); sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import torch

torch.set_num_threads(2)
import gemma3 as ex
from hubtools.build import build_kernel, load_build
from hubtools.e2e.quality import calibration_batches, load_text, perplexity, quantize
from hubtools.workspace import Workspace

model, tok, _, _ = ex.load_gemma3()
ids = load_text(tok, 1024)
with tempfile.TemporaryDirectory() as d:
    w4 = load_build(build_kernel(Workspace.load(Path(__file__).resolve().parents[3]).kernel("w4a16"), Path(d)))
    F, plain, plain_gptq = w4.formats, w4.formats.group_params, w4.layers.gptq_quantize
    state = {}

    def weighted(w, *, fmt, zero_point, dtype, grid=torch.linspace(1.0, 0.70, 16)):
        g = state["next"]
        state["next"] += 1
        h = state["diag"][g * w.shape[-1]:(g + 1) * w.shape[-1]]

        def err(s, z):
            sb, zb = s.unsqueeze(-1), None if z is None else z.unsqueeze(-1)
            return ((w - F.decode(F.encode(w, sb, zb, fmt=fmt), sb, zb, fmt=fmt)).pow(2) * h).sum(-1)
        best_s, best_z = plain(w, fmt=fmt, zero_point=zero_point, dtype=dtype)
        best_e = err(best_s, best_z)
        for p in grid[1:]:
            s, z = plain(w * p, fmt=fmt, zero_point=zero_point, dtype=dtype)
            e = err(s, z)
            better = e < best_e
            best_e, best_s = torch.where(better, e, best_e), torch.where(better, s, best_s)
            if z is not None:
                best_z = torch.where(better, z, best_z)
        return best_s, best_z

    def gptq_weighted(weight, hessian, **kw):
        diag = torch.diagonal(hessian).float()
        if kw.get("act_order"):
            diag = diag[torch.argsort(torch.diagonal(hessian.double()), descending=True, stable=True)]
        state.update(diag=diag, next=0)
        w4.gptq.group_params = weighted
        try:
            return plain_gptq(weight, hessian, **kw)
        finally:
            w4.gptq.group_params = plain

    w4.layers.gptq_quantize = gptq_weighted
    calib = calibration_batches(copy.deepcopy(model).to(torch.float32), tok, "cpu", **ex.CALIBRATION)
    for name in sys.argv[1:]:
        spec = ex.VARIANTS[name]
        m, t = copy.deepcopy(model), time.time()
        quantize(m, w4, spec["fmt"], spec["group_size"], spec["zero_point"], calib, act_order=spec.get("act_order", False))
        ppl = perplexity(m, ids, 512, 512, bos_token_id=tok.bos_token_id)
        print(json.dumps({"variant": name + "-weighted-clip", "ppl": round(ppl, 4), "s": round(time.time() - t, 1)}),
              flush=True)
