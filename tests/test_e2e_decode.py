"""scripts/e2e_decode.py on the CPU: the decode loop, configurations, breakdown and bytes of a tiny Llama.

The decode loops run the kernels' PyTorch paths (TRITON_INTERPRET=0): the interpreter takes about 0.4 s
per int4 matmul call at these sizes (16 GEMV programs per 128 padded rows), so one interpreted decode step
of the tiny model costs seconds; `test_interpreted_step_matches_pytorch_path` runs one such step through
the Triton kernels. Their numerics are covered in depth by test_w4a16.py and test_rmsnorm.py.
"""

import dataclasses
import json

import pytest
import torch

from hubtools.e2e import decode as e2e

SETTINGS = e2e.Settings(prompt_len=8, steps=4, check_steps=12, reps=1, profile_steps=1)
NOMINAL_BW = 1e12  # a made-up copy bandwidth: exercises the roofline arithmetic, claims nothing


@pytest.fixture(scope="module")
def kernels(load_kernel, built_kernel_dir):
    from kernels import LocalLayerRepository

    found = e2e.Kernels(w4a16=load_kernel("w4a16"), rmsnorm=load_kernel("rmsnorm"),
                        rmsnorm_dir=built_kernel_dir("rmsnorm"))
    # kernelize imports the rmsnorm layer on first use and triton.jit fixes interpreter-or-not at import:
    # import it now, under the session's TRITON_INTERPRET, before any test switches to the PyTorch path.
    LocalLayerRepository(repo_path=found.rmsnorm_dir, layer_name="RMSNorm").load()
    return found


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def rows(kernels):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        got = e2e.run_model(e2e.MODELS["tiny"], kernels, "cpu", SETTINGS, NOMINAL_BW, log=lambda s: None)
    return {row["config"]: row for row in got}


def test_configs_run_in_order_with_kernels_in_place(rows):
    assert list(rows) == list(e2e.CONFIGS)
    layers = e2e.MODELS["tiny"].layers
    assert rows["w4a16+rmsnorm"]["norms_kernelized"] == 2 * layers + 1
    assert rows["w4a16+rmsnorm+fused"]["residual_adds_fused"] == 2 * layers
    assert "norms_kernelized" not in rows["w4a16+rmsnorm+fused"]  # kernelized once, by the configuration before
    assert rows[e2e.LM_HEAD_CONFIG]["lm_head_quantized"] and "lm_head_quantized" not in rows["w4a16+rmsnorm+fused"]
    assert rows["bf16"]["speedup_vs_bf16"] == pytest.approx(1.0)
    for row in rows.values():
        assert row["graph"] is False and row["device"] == "cpu"
        assert len(row["correctness"]["tokens"]) == SETTINGS.check_steps


def test_quantized_decode_close_to_bf16(rows):
    """Teacher-forced logits of the int4 model against bf16's. Round-to-nearest int4 with group 128 adds
    noise of step/sqrt(12) = (absmax/7.5)/sqrt(12), about 11% of a Gaussian weight's scale (absmax ~2.9
    sigma over 128 values), to each matmul's output; about four quantized matmuls in series (v -> o,
    gate/up -> down, two layers) compound to ~0.2, and seeds 0-4 give 0.15-0.24 (a quantized lm_head adds one
    more in series). 0.35 leaves that margin
    and still fails a broken weight (unrelated logits give ~1.4). The random model's logits are nearly flat
    (top-1 margins a fraction of that noise), so top-1 agreement is only required far above chance
    (1/512; seeds 0-4 give 0.42-0.83); exact greedy agreement is checked against the dequantized model
    (next test)."""
    for config in ("w4a16", "w4a16+rmsnorm", "w4a16+rmsnorm+fused", e2e.LM_HEAD_CONFIG):
        c = rows[config]["correctness"]
        assert 0 < c["teacher_forced_logits_rel_err"] < 0.35, (config, c)
        assert c["teacher_forced_top1_agreement"] >= 0.25, (config, c)
    # The rmsnorm layer computes LlamaRMSNorm's function with its rounding points: nothing else changes.
    a, b = rows["w4a16"]["correctness"], rows["w4a16+rmsnorm"]["correctness"]
    assert a["tokens"] == b["tokens"]
    assert b["teacher_forced_logits_rel_err"] == pytest.approx(a["teacher_forced_logits_rel_err"], abs=1e-2)
    # On the PyTorch path the fused add + norm is the same rounded add and the same norm: bit for bit the same.
    c = rows["w4a16+rmsnorm+fused"]["correctness"]
    assert c["tokens"] == b["tokens"]
    assert c["teacher_forced_logits_rel_err"] == b["teacher_forced_logits_rel_err"]


def test_w4a16_greedy_tokens_match_dequantized_bf16(rows):
    """The int4 model computes the bf16 model with dequantized weights: same greedy tokens, logits equal
    up to bf16 rounding of each matmul's output (one rounding, 2^-8 relative, through a few layers)."""
    for config in ("w4a16", "w4a16+rmsnorm", "w4a16+rmsnorm+fused", e2e.LM_HEAD_CONFIG):
        check = rows[config]["correctness"]["vs_dequantized_bf16"]
        assert check["greedy_tokens_matching_prefix"] == SETTINGS.check_steps, (config, check)
        assert check["teacher_forced_top1_agreement"] == 1.0, (config, check)
        assert check["teacher_forced_logits_rel_err"] < 2e-2, (config, check)


@pytest.mark.parametrize("config", ["w4a16+rmsnorm", "w4a16+rmsnorm+fused"])
def test_interpreted_step_matches_pytorch_path(kernels, monkeypatch, config):
    """One decode step of the w4a16+rmsnorm model (without and with the residual adds fused) through the Triton
    kernels (interpreter) against the kernels' PyTorch path: the same function, so logits agree to bf16 rounding."""
    spec = dataclasses.replace(e2e.MODELS["tiny"], layers=1)
    model = e2e.build_model(spec, "cpu", seed=5)
    state = {}
    e2e.apply_config(model, config, kernels, "cpu", state)
    prompt = torch.randint(0, spec.vocab, (1, 4), generator=torch.Generator().manual_seed(6))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    decoder = e2e.Decoder(model, prompt, 8, use_graph=False)
    want = decoder.step().float().clone()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    decoder.reset()
    got = decoder.step().float()
    assert ((got - want).norm() / want.norm()).item() < 2e-2


def test_breakdown_sums_to_step(rows):
    for row in rows.values():
        parts = row["breakdown"]
        assert set(parts) == set(e2e.CATEGORIES)
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) == pytest.approx(row["seconds_per_token"], rel=1e-9)
        # every category is found by the module annotation (the model has all four kinds of work)
        busy = row["breakdown_detail"]["busy_seconds_per_step"]
        assert all(busy[c] > 0 for c in ("matmul", "attention", "norms", "rest")), busy
    assert 1e3 * rows["bf16"]["seconds_per_token"] == pytest.approx(rows["bf16"]["ms_per_token"])


def test_fused_norms_count_as_norms(kernels, torch_path):
    """The fused residual add + norm runs in the decoder layer's own forward, outside any RMSNorm module: the
    breakdown finds it by the rmsnorm op's name, so its time (adds included) counts as norms, not rest."""
    from torch.profiler import ProfilerActivity, profile

    spec = e2e.MODELS["tiny"]
    model = e2e.build_model(spec, "cpu", seed=3)
    e2e.apply_config(model, "w4a16+rmsnorm+fused", kernels, "cpu", {})
    prompt = torch.randint(0, spec.vocab, (1, 4), generator=torch.Generator().manual_seed(4))
    decoder = e2e.Decoder(model, prompt, 8, use_graph=False)
    handles = e2e._annotate(e2e._labels(model))
    try:
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            decoder._step()
    finally:
        for h in handles:
            h.remove()
    events = prof.events()
    fused = [e for e in events if e.name.endswith("::fused_add_rms_norm")]
    assert len(fused) == 2 * spec.layers and all(e2e._is_norm_op(e.name) for e in fused)
    inside = [e for e in events if e.cpu_parent in fused]  # the PyTorch path's add, statistics and casts
    assert inside and {e2e._label_of(e) for e in fused + inside} == {"norms"}
    assert not e2e._is_norm_op("aten::rms_norm")
    by_label, _, _, _ = e2e.attribute(events, on_device=False)
    assert by_label["norms"] >= sum(e.self_cpu_time_total for e in fused + inside)


def test_matmul_kinds_are_counted_per_call(rows):
    """The breakdown splits matmul time by kind: the stock model's seven projections and lm_head, the w4a16 model's
    fused qkv and gate/up (with the SwiGLU epilogue), each called once per layer; no microbenchmark on the CPU."""
    layers = e2e.MODELS["tiny"].layers
    want = {"bf16": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"},
            "w4a16": {"qkv", "o_proj", "gate_up+swiglu", "down_proj", "lm_head"}}
    for config, kinds in want.items():
        got = {k["kind"]: k for k in rows[config]["breakdown_detail"]["matmul_kinds"]}
        assert set(got) == kinds
        for name, kind in got.items():
            assert kind["calls_per_step"] == (1 if name == "lm_head" else layers)
            assert kind["in_model_us_per_call"] > 0 and kind["micro_us_per_call"] is None


def test_swiglu_mlp_counts_as_matmul(kernels, torch_path):
    """The fused gate/up matmul with the SwiGLU epilogue runs in GateUpMLP's own forward (not a W4A16Linear's), so
    the breakdown annotates that module as matmul; a GateUpMLP without it keeps its SiLU * mul under rest."""
    model = e2e.quantize(e2e.build_model(e2e.MODELS["tiny"], "cpu"), kernels)
    mlps = [m for m in model.modules() if type(m).__name__ == "GateUpMLP"]
    assert mlps and all(m.swiglu and e2e.category(m) == "matmul" for m in mlps)
    mlps[0]._set_layout(False)
    assert e2e.category(mlps[0]) is None


def _linear_weights(spec):
    """Elements of every decoder matrix per layer, and of lm_head, from the spec alone."""
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    per_layer = [(q, spec.hidden), (kv, spec.hidden), (kv, spec.hidden), (spec.hidden, q),
                 (spec.intermediate, spec.hidden), (spec.intermediate, spec.hidden), (spec.hidden, spec.intermediate)]
    return per_layer, (spec.vocab, spec.hidden)


def _w4a16_weights(spec):
    """The w4a16 configuration's matrices per layer: quantize_model fuses q/k/v and gate/up (one padded weight each)."""
    (q, hidden), (kv, _), _, o, (inter, _), _, down = _linear_weights(spec)[0]
    return [(q + 2 * kv, hidden), o, (2 * inter, hidden), down]


def test_bytes_accounting(rows):
    spec = e2e.MODELS["tiny"]
    per_layer, lm_head = _linear_weights(spec)
    decoder_elems = spec.layers * sum(n * k for n, k in per_layer)
    bf16, w4, w4n, w4f = rows["bf16"], rows["w4a16"], rows["w4a16+rmsnorm"], rows["w4a16+rmsnorm+fused"]
    assert bf16["bytes_actual_parts"]["matrices"] == 2 * (decoder_elems + lm_head[0] * lm_head[1])
    # int4: rows padded to 128, K to 128; codes 4 bits + one bf16 scale per 128 K-columns; lm_head bf16
    pad = lambda v: -(-v // 128) * 128  # noqa: E731
    packed = spec.layers * sum(pad(n) * pad(k) // 2 + pad(k) // 128 * pad(n) * 2 for n, k in _w4a16_weights(spec))
    assert w4["bytes_actual_parts"]["matrices"] == packed + 2 * lm_head[0] * lm_head[1]
    ideal = spec.layers * sum(n * k // 2 + k // 128 * n * 2 for n, k in per_layer)
    ideal += lm_head[0] * lm_head[1] // 2 + lm_head[1] // 128 * lm_head[0] * 2
    assert bf16["bytes_ideal_parts"]["matrices"] == ideal
    biases = spec.layers * 2 * (spec.heads + 2 * spec.kv_heads) * spec.head_dim  # q, k, v only
    norms = 2 * spec.hidden * (2 * spec.layers + 1)
    for row in rows.values():
        assert row["bytes_actual_parts"]["biases"] == biases
        assert row["bytes_actual_parts"]["norms"] == norms
        assert row["bytes_actual_parts"]["embedding_row"] == 2 * spec.hidden
        assert row["bytes_ideal"] <= row["bytes_actual"]
        assert row["bytes_ideal"] == bf16["bytes_ideal"]  # the ideal is the model's, not the config's
        assert row["bytes_actual"] == sum(row["bytes_actual_parts"].values())
        assert row["ceiling_actual_tokens_per_s"] == pytest.approx(NOMINAL_BW / row["bytes_actual"])
        assert row["fraction_of_ideal_ceiling"] == pytest.approx(row["tokens_per_s"] * row["bytes_ideal"] / NOMINAL_BW)
    assert w4["bytes_actual"] < bf16["bytes_actual"]
    assert w4n["bytes_actual"] == w4f["bytes_actual"] == w4["bytes_actual"]
    # lm_head at int4 as well: its bf16 bytes replaced by codes and scales
    head = pad(lm_head[0]) * pad(lm_head[1]) // 2 + pad(lm_head[1]) // 128 * pad(lm_head[0]) * 2
    assert rows[e2e.LM_HEAD_CONFIG]["bytes_actual_parts"]["matrices"] == packed + head
    # KV: the static buffer read, GQA's repeated copy written and read again, the new position written
    kv_pos = 2 * spec.head_dim * 2
    want_kv = spec.layers * kv_pos * (SETTINGS.cache_len * (spec.kv_heads + 2 * spec.heads) + spec.kv_heads)
    assert bf16["bytes_actual_parts"]["kv_cache"] == want_kv
    assert bf16["bytes_ideal_parts"]["kv_cache"] == int(spec.layers * kv_pos * spec.kv_heads * SETTINGS.context_len)


def test_tied_lm_head_reads_the_whole_embedding(kernels, torch_path):
    """With tied embeddings lm_head is the embedding matrix, read whole in bf16 each step (not quantized)."""
    spec = dataclasses.replace(e2e.MODELS["tiny"], tied=True)
    model = e2e.build_model(spec, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    e2e.quantize(model, kernels)
    assert type(model.lm_head).__name__ == "Linear"
    actual, ideal = e2e.decode_bytes(model, cache_len=16, context_len=8)
    _, (vocab, hidden) = _linear_weights(spec)
    pad = lambda v: -(-v // 128) * 128  # noqa: E731
    packed = spec.layers * sum(pad(n) * pad(k) // 2 + pad(k) // 128 * pad(n) * 2 for n, k in _w4a16_weights(spec))
    assert actual["matrices"] == packed + 2 * vocab * hidden
    assert actual["embedding_row"] == 2 * hidden
    assert ideal["matrices"] < actual["matrices"]
    # the lm_head configuration quantizes the tied lm_head; the embedding keeps its bf16 weight for lookups
    e2e.apply_config(model, e2e.LM_HEAD_CONFIG, kernels, "cpu", {"quantized": True, "kernelized": True, "fused": True})
    assert type(model.lm_head).__name__ == "W4A16Linear"
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert e2e.decode_bytes(model, cache_len=16, context_len=8)[0]["matrices"] < actual["matrices"]


def test_cli_writes_results(tmp_path, torch_path):
    out = tmp_path / "e2e.json"
    assert e2e.main(["--tiny", "--device", "cpu", "--configs", "bf16", "--prompt-len", "4", "--steps", "2",
                     "--check-steps", "2", "--reps", "1", "--profile-steps", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"gpu", "sm_count", "date", "torch", "triton", "cuda", "transformers", "python", "command"} <= set(data["env"])
    assert data["copy_bandwidth"] is None and data["notes"]
    assert [(r["model"], r["config"]) for r in data["rows"]] == [("tiny", "bf16")]
