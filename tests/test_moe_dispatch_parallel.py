"""moe-dispatch expert parallelism (parallel.py) on CPU with gloo, at 2 and 4 processes started here.

Each world size is one start of W processes (forkserver with torch preloaded: each child is a fork of a fresh
interpreter, not of this pytest process) that load the built kernel from the session's build folder
(`built_kernel_dir`, the way `load_kernel` does), run every case below in the same order (collectives pair
up across ranks) and write each case's outcome; one test per (world size, case) reads them. Children take
the PyTorch path (TRITON_INTERPRET=0). References are the same kernel's single-process `moe_forward` /
`fused_experts` on the full weights, in the same process. Tolerances: fp32 rtol 1e-5 (only the order of
fp32 sums differs: a token's per-rank partial sums are added in rank order); bf16 1e-2 of the norm (one
more bf16 rounding, of each rank's partial sum).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import time
import traceback
from pathlib import Path

import pytest
import torch

WORLD_SIZES = (2, 4)
RUN_TIMEOUT = 300  # seconds for one world size's processes; a rank stuck in a collective times out at 60
H, I = 32, 16


# ----------------------------------------------------------------------------------------------------
# Cases, run in every child in this order
# ----------------------------------------------------------------------------------------------------

CASES: dict[str, tuple] = {}  # name -> (function(k, rank, world, tmp), world sizes)


def case(name: str, worlds=WORLD_SIZES):
    def register(fn):
        CASES[name] = (fn, worlds)
        return fn
    return register


def _experts(E, dtype, seed=0, intermediate=I):
    g = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(E, 2 * intermediate, H, generator=g) / H**0.5).to(dtype)
    w_down = (torch.randn(E, H, intermediate, generator=g) / intermediate**0.5).to(dtype)
    return w_gate_up, w_down


def _tokens(rank, T, dtype, seed=10):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed + rank)).to(dtype)


def _close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype, (out.shape, ref.shape, out.dtype)
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    elif ref.numel():
        diff = (out.float() - ref.float()).norm() / ref.float().norm()
        assert diff <= 1e-2, f"relative error {diff:.2e}"


def _moe_case(k, rank, world, *, dtype, capacity, deepseek, tokens):
    E, top_k = 8, (3 if deepseek else 2)
    w_gate_up, w_down = _experts(E, dtype)
    g = torch.Generator().manual_seed(1)
    router = torch.randn(E, H, generator=g) / H**0.5
    spec = {}
    if deepseek:  # sigmoid, groups, bias, scaling, a replicated shared expert fused-size (I' = I)
        shared = _experts(1, dtype, seed=2)
        spec = dict(scoring="sigmoid", num_groups=4, topk_groups=2, scaling_factor=2.5,
                    correction_bias=torch.randn(E, generator=g) * 0.3,
                    shared_gate_up=shared[0][0], shared_down=shared[1][0])
    else:
        router = router.to(dtype)
    x = _tokens(rank, tokens(rank), dtype)
    ep = k.ExpertParallel(capacity=capacity)
    out = k.moe_forward(x[None], router, ep.shard(w_gate_up), ep.shard(w_down), top_k, expert_parallel=ep, **spec)
    assert out.shape == (1, *x.shape)
    _close(out[0], k.moe_forward(x, router, w_gate_up, w_down, top_k, **spec), dtype)
    assert ep.dropped_count() == 0


def _biggest(world, tokens):
    return max(tokens(r) for r in range(world))


def _uneven(rank):
    return 3 + 2 * rank


def _six(rank):
    return 6


def _empty_even_ranks(rank):
    return 0 if rank % 2 == 0 else 4


@case("moe fp32 variable")
def _(k, rank, world, tmp):
    _moe_case(k, rank, world, dtype=torch.float32, capacity=None, deepseek=False, tokens=_uneven)


@case("moe fp32 capacity")
def _(k, rank, world, tmp):
    _moe_case(k, rank, world, dtype=torch.float32, capacity=_biggest(world, _uneven), deepseek=False, tokens=_uneven)


@case("moe bf16 deepseek shared variable")
def _(k, rank, world, tmp):
    _moe_case(k, rank, world, dtype=torch.bfloat16, capacity=None, deepseek=True, tokens=_six)


@case("moe bf16 deepseek shared capacity")
def _(k, rank, world, tmp):
    _moe_case(k, rank, world, dtype=torch.bfloat16, capacity=6, deepseek=True, tokens=_six)


@case("empty ranks variable")
def _(k, rank, world, tmp):
    _moe_case(k, rank, world, dtype=torch.float32, capacity=None, deepseek=True, tokens=_empty_even_ranks)


@case("empty ranks capacity")
def _(k, rank, world, tmp):
    _moe_case(k, rank, world, dtype=torch.float32, capacity=4, deepseek=False, tokens=_empty_even_ranks)


def _skewed(k, rank, world, capacity, dtype):
    """Every token of every rank picks experts of the last rank only: it receives all, the others none."""
    E, T = 8, 5
    w_gate_up, w_down = _experts(E, dtype)
    x = _tokens(rank, T, dtype)
    last = torch.arange(E // world * (world - 1), E)
    ids = torch.stack([last[torch.randperm(len(last), generator=torch.Generator().manual_seed(t))[:2]]
                       for t in range(T)]).int()
    weights = torch.rand(T, 2, generator=torch.Generator().manual_seed(rank))
    ep = k.ExpertParallel(capacity=capacity)
    out = k.fused_experts(x, ep.shard(w_gate_up), ep.shard(w_down), weights, ids, expert_parallel=ep)
    _close(out, k.fused_experts(x, w_gate_up, w_down, weights, ids), dtype)
    assert ep.dropped_count() == 0


@case("skewed to one rank variable")
def _(k, rank, world, tmp):
    _skewed(k, rank, world, None, torch.float32)


@case("skewed to one rank capacity bf16")
def _(k, rank, world, tmp):
    _skewed(k, rank, world, 5, torch.bfloat16)


@case("capacity overflow reported")
def _(k, rank, world, tmp):
    """Capacity 2 with 6 tokens per rank: tokens past the 2nd bound for a rank are not sent there; the count of
    (token, expert) assignments not computed is reported, and the output is exactly the rest."""
    E, T, top_k, capacity = 8, 6, 2, 2
    n_local = E // world
    w_gate_up, w_down = _experts(E, torch.float32)
    x = _tokens(rank, T, torch.float32)
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).int()
    weights = torch.rand(T, top_k, generator=g) + 0.1
    kept = torch.ones(T, top_k, dtype=torch.bool)
    expected = 0
    for r in range(world):  # written independently of parallel.py: first come, first served, per rank
        bound = [t for t in range(T) if any(int(e) // n_local == r for e in ids[t])]
        for t in bound[capacity:]:
            for j in range(top_k):
                if int(ids[t, j]) // n_local == r:
                    kept[t, j] = False
                    expected += 1
    ep = k.ExpertParallel(capacity=capacity)
    shard = (ep.shard(w_gate_up), ep.shard(w_down))
    out = k.fused_experts(x, *shard, weights, ids, expert_parallel=ep)
    _close(out, k.fused_experts(x, w_gate_up, w_down, weights * kept, ids), torch.float32)
    assert ep.dropped_count() == expected, (ep.dropped_count(), expected)
    total = torch.tensor([expected])
    torch.distributed.all_reduce(total)
    assert int(total) > 0, "the case must overflow somewhere"
    k.fused_experts(x, *shard, weights, ids, expert_parallel=ep)
    assert ep.dropped_count() == 2 * expected  # it accumulates
    ep.reset_dropped()
    assert ep.dropped_count() == 0


@case("bad input names the argument")
def _(k, rank, world, tmp):
    """Errors raised before any collective, the same on every rank."""
    E = 8
    w_gate_up, w_down = _experts(E, torch.float32)
    x = _tokens(rank, 3, torch.float32)
    ep = k.ExpertParallel()
    shard = (ep.shard(w_gate_up), ep.shard(w_down))
    weights, ids = torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int32)
    calls = [
        (lambda: k.moe_forward(x, torch.randn(2 * world + 1, H), *shard, 2, expert_parallel=ep), ValueError,
         "router_weight"),
        (lambda: k.moe_forward(x, torch.randn(2 * E, H), *shard, 2, expert_parallel=ep), ValueError, "w_gate_up"),
        (lambda: k.moe_forward(x, torch.randn(E, H), w_gate_up, w_down, 2, expert_parallel=ep), ValueError,
         "w_gate_up"),
        (lambda: k.moe_forward(x, torch.randn(E, H), *shard, 2, expert_parallel="world"), TypeError,
         "expert_parallel"),
        (lambda: k.moe_forward(x, torch.randn(E, H), *shard, E + 1, expert_parallel=ep), ValueError, "top_k"),
        (lambda: k.fused_experts(x, *shard, weights, ids + E, expert_parallel=ep), ValueError, "topk_ids"),
        (lambda: k.fused_experts(x, *shard, weights, ids - 1, expert_parallel=ep), ValueError, "topk_ids"),
        (lambda: k.fused_experts(x, shard[0], shard[1][:, :, :8], weights, ids, expert_parallel=ep), ValueError,
         "w_down"),
        (lambda: k.fused_experts(x, *shard, weights, ids, expert_parallel=3), TypeError, "expert_parallel"),
        (lambda: k.ExpertParallel(capacity=0), ValueError, "capacity"),
        (lambda: k.ExpertParallel(capacity="8"), TypeError, "capacity"),
        (lambda: k.ExpertParallel(capacity=True), TypeError, "capacity"),
        (lambda: k.ExpertParallel("world"), TypeError, "group"),
        (lambda: ep.shard(torch.zeros(2 * world + 1, 3)), ValueError, "experts cannot be split"),
    ]
    for i, (call, error, match) in enumerate(calls):
        try:
            call()
        except error as exc:
            assert match in str(exc), f"call {i}: {exc!r} does not name {match!r}"
        else:
            raise AssertionError(f"call {i} did not raise {error.__name__} ({match})")


@case("transformers expert-parallel plans", worlds=(2,))
def _(k, rank, world, tmp):
    """A tiny Mixtral loaded with transformers' own expert parallelism (DistributedConfig(ep_size=W), experts
    sharded by its plan) runs its experts on this kernel: the default token-dispatch plan and the router plan
    (sentinel ids for other ranks' experts, then all-reduce) both give the unsharded eager model's logits."""
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.integrations.moe import ExpertsInterface

    path = Path(tmp) / "tiny-mixtral"
    if rank == 0:
        torch.manual_seed(0)
        config = MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=64)
        MixtralForCausalLM(config).save_pretrained(path)
    torch.distributed.barrier()
    calls = []

    def counted(self, hidden_states, top_k_index, top_k_weights):
        calls.append((bool(self._is_expert_parallel), bool((top_k_index == self.num_experts).any())))
        return k.experts_forward(self, hidden_states, top_k_index, top_k_weights)

    ExpertsInterface.register("moe_dispatch", counted)
    input_ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))  # the same on every rank
    with torch.no_grad():
        eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        eager.set_experts_implementation("eager")
        ref = eager(input_ids).logits
        plans = {"dispatch": None,
                 "router": {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}}
        for plan, ep_plan in plans.items():
            config = DistributedConfig(tp_size=world, tp_plan={}, ep_size=world, ep_plan=ep_plan)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config).eval()
            assert model.model.layers[0].mlp.experts.num_experts == 4 // world
            model.set_experts_implementation("moe_dispatch")
            calls.clear()
            logits = model(input_ids).logits
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{plan} plan: {m}")
            assert calls and all(sharded for sharded, _ in calls), f"{plan} plan: kernel not called on shards"
            if plan == "router":
                assert any(sentinel for _, sentinel in calls), "router plan: no sentinel ids seen"


def _child(rank: int, world: int, built: str, tmp: str) -> None:
    os.environ["TRITON_INTERPRET"] = "0"  # the PyTorch path (read at call time)
    # gloo on CPU tensors also on a GPU host, where transformers' from_pretrained would place the model on the GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        from hubtools.build import load_build

        start = time.perf_counter()
        k = load_build(Path(built))
        loaded = time.perf_counter()
        torch.distributed.barrier()  # gloo connects the ranks here
        outcomes = {"_setup": {"load": loaded - start, "barrier": time.perf_counter() - loaded}}
        for name, (fn, worlds) in CASES.items():
            if world not in worlds:
                continue
            start = time.perf_counter()
            try:
                fn(k, rank, world, tmp)
                outcomes[name] = {"error": None, "seconds": time.perf_counter() - start}
            except Exception:
                outcomes[name] = {"error": traceback.format_exc(), "seconds": time.perf_counter() - start}
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(outcomes))
    finally:
        torch.distributed.destroy_process_group()


def _join(context, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:  # the ranks this test started, by their handles
                if process.is_alive():
                    process.kill()
            pytest.fail(f"expert-parallel ranks still running after {timeout} s")


def _start(world: int, built: Path, tmp: Path) -> list[dict]:
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "kernels"])  # imports each rank needs
    context = mp.start_processes(_child, args=(world, str(built), str(tmp)), nprocs=world, join=False,
                                 start_method="forkserver")
    _join(context, RUN_TIMEOUT)
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def outcomes(built_kernel_dir, tmp_path_factory):
    """`outcomes(W)` -> per rank {case: {"error", "seconds"}}; each world size runs once."""
    runs = {}

    def get(world):
        if world not in runs:
            runs[world] = _start(world, built_kernel_dir("moe-dispatch"), tmp_path_factory.mktemp(f"ep{world}"))
        return runs[world]

    return get


@pytest.mark.parametrize("world,name", [(w, name) for w in WORLD_SIZES for name, (_, ws) in CASES.items() if w in ws],
                         ids=lambda v: str(v).replace(" ", "-"))
def test_expert_parallel_gloo(outcomes, world, name):
    failures = [f"rank {rank}:\n{o[name]['error']}" for rank, o in enumerate(outcomes(world)) if o[name]["error"]]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------------------------
# In this process
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k(load_kernel):
    return load_kernel("moe-dispatch")


def test_needs_an_initialized_group(k):
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="group: torch.distributed is not initialized"):
        k.ExpertParallel()


def test_sentinel_ids_select_nothing(k, path):
    """The local op with allow_sentinel (a rank's shard): id E selects nothing, top_k may exceed the shard's E,
    other ids outside [0, E] are still refused on CPU."""
    E, T = 2, 6
    g = torch.Generator().manual_seed(0)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w_down = torch.randn(E, H, I, generator=g) / I**0.5
    x = torch.randn(T, H, generator=g)
    ids = torch.tensor([[0, 2, 2], [2, 2, 2], [1, 0, 2], [2, 1, 2], [0, 2, 1], [2, 2, 0]], dtype=torch.int32)
    weights = torch.rand(T, 3, generator=g)
    out = k.ops.fused_experts(x, w_gate_up, w_down, weights, ids, "silu", True)
    expect = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(3):
            if ids[t, j] < E:  # float64, one (token, slot) pair at a time
                e = int(ids[t, j])
                gate_up = w_gate_up[e].double() @ x[t].double()
                act = torch.nn.functional.silu(gate_up[:I]) * gate_up[I:]
                expect[t] += float(weights[t, j]) * (w_down[e].double() @ act)
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 2\]"):
        k.ops.fused_experts(x, w_gate_up, w_down, weights, ids + 1, "silu", True)
    with pytest.raises(ValueError, match="top_k"):
        k.ops.fused_experts(x, w_gate_up, w_down, weights, ids.clamp(max=1), "silu")


def test_capacity_mode_has_no_host_sync(k):
    """The fixed-capacity layer under FakeTensorMode with a fake process group (W = 4): any host read of device
    data (item, tolist, nonzero, a data-dependent branch) raises there, so a pass means a CUDA graph can hold
    it. The variable mode reads its split sizes and must raise (the check sees syncs)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    E = 8
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        def layer(capacity):
            ep = k.ExpertParallel(capacity=capacity)
            with FakeTensorMode():
                x = torch.randn(5, H, dtype=torch.bfloat16)
                w_gate_up, w_down = torch.randn(2, 2 * I, H).bfloat16(), torch.randn(2, H, I).bfloat16()
                out = k.moe_forward(x, torch.randn(E, H), w_gate_up, w_down, 3, scoring="sigmoid", num_groups=4,
                                    topk_groups=2, correction_bias=torch.randn(E), shared_gate_up=w_gate_up[0],
                                    shared_down=w_down[0], expert_parallel=ep)
                assert out.shape == x.shape and ep.dropped.shape == ()

        layer(capacity=4)
        with pytest.raises(DataDependentOutputException):
            layer(capacity=None)
    finally:
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# The --ep benchmark's plan and code (the numbers need >= 2 GPUs)
# ----------------------------------------------------------------------------------------------------


def test_ep_benchmark_arguments():
    from hubtools.bench import moe_dispatch as bench

    assert bench.ep_world_sizes("auto", 8) == [2, 4, 8]
    assert bench.ep_world_sizes("auto", 3) == [2]
    assert bench.ep_world_sizes("4,2", 4) == [2, 4]
    for spec, gpus, match in [("auto", 1, "at least 2 CUDA GPUs"), ("auto", 0, "found 0"), ("2,x", 4, "2,4"),
                              ("8", 4, r"\[2, 4\]"), ("1", 4, r"\[2, 4\]"), ("3", 4, "does not divide")]:
        with pytest.raises(ValueError, match=match):
            bench.ep_world_sizes(spec, gpus)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host can run the EP benchmark")
def test_ep_benchmark_refuses_without_two_gpus(capsys):
    from hubtools.bench.cli import bench_main

    with pytest.raises(SystemExit) as exit_info:
        bench_main(["moe-dispatch", "--ep"])
    assert exit_info.value.code == 2
    assert "needs at least 2 CUDA GPUs on this host" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["rmsnorm", "--ep"])
    assert "--ep is the moe-dispatch expert-parallel benchmark" in capsys.readouterr().err


def test_ep_benchmark_cli_writes_after_each_world_size(monkeypatch, tmp_path):
    """With GPUs faked: the plan reaches run_ep and each world size's results land in one merged file."""
    from hubtools.bench import moe_dispatch as bench
    from hubtools.bench.cli import bench_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    seen = []

    def fake_run_ep(built, world_sizes, progress):
        assert (Path(built) / "build").is_dir()
        seen.append(world_sizes)
        for done in range(1, len(world_sizes) + 1):
            progress({"mode": "expert-parallel", "env": {}, "world_sizes": world_sizes[:done],
                      "rows": [{"case": f"m W={w}", "world_size": w} for w in world_sizes[:done]]})

    monkeypatch.setattr(bench, "run_ep", fake_run_ep)
    assert bench_main(["moe-dispatch", "--ep", "--out-dir", str(tmp_path)]) == 0
    assert bench_main(["moe-dispatch", "--ep", "2", "--out-dir", str(tmp_path)]) == 0
    assert seen == [[2, 4], [2]]
    written = json.loads((tmp_path / "moe-dispatch-ep-results.json").read_text())
    assert written["world_sizes"] == [2, 4] and sorted(r["world_size"] for r in written["rows"]) == [2, 4]


def test_ep_goals():
    from hubtools.bench import moe_dispatch as bench

    def rows(case, tokens, ours, ideal):
        return [{"case": case, "impl": "ours (EP, variable)", "seconds": ours, "tokens_per_rank": tokens},
                {"case": case, "impl": "single GPU / W + all-to-all (variable)", "seconds": ideal}]

    results = {"mode": "expert-parallel", "rows": rows("deepseek-v3 W=2 T=4096", 4096, 1.2, 1.0)
               + rows("deepseek-v3 W=4 T=4096", 4096, 1.5, 1.0) + rows("mixtral-8x7b W=2 T=4096", 4096, 9.0, 1.0)
               + rows("deepseek-v3 W=2 T=64", 64, 9.0, 1.0)}
    goals = bench.goals(results)
    assert [(g["case"], g["value"], g["met"]) for g in goals] == [("deepseek-v3 W=2 T=4096", 1.2, True),
                                                                  ("deepseek-v3 W=4 T=4096", 1.5, False)]
    assert all(g["target"] == 1.3 and g["at_most"] for g in goals)


def test_ep_results_of_two_hosts_merge():
    from hubtools.bench import moe_dispatch as bench

    def results(sizes, tag):
        return {"mode": "expert-parallel", "env": {"host": tag}, "world_sizes": sizes,
                "rows": [{"case": f"m W={w} T=1", "world_size": w, "tag": tag} for w in sizes]}

    first = bench.merge_ep_results(None, results([2], "a"))
    merged = bench.merge_ep_results(first, results([4, 8], "b"))
    assert merged["world_sizes"] == [2, 4, 8]
    assert [(r["world_size"], r["tag"]) for r in merged["rows"]] == [(2, "a"), (4, "b"), (8, "b")]
    assert merged["env_by_world_size"] == {"2": {"host": "a"}, "4": {"host": "b"}, "8": {"host": "b"}}
    again = bench.merge_ep_results(merged, results([2], "c"))
    assert sorted((r["world_size"], r["tag"]) for r in again["rows"]) == [(2, "c"), (4, "b"), (8, "b")]


def test_ep_benchmark_runs_on_cpu(built_kernel_dir):
    """The whole --ep benchmark code path (ranks started by run_ep, every measurement, the results file) on
    gloo with a tiny DeepSeek-like layer, both modes (variable from T = 8), an empty rank batch (T = 0)."""
    from hubtools import report
    from hubtools.bench import moe_dispatch as bench

    tiny = {"deepseek-v3": bench.Model(8, 3, 32, 16, dict(scoring="sigmoid", renormalize=True, num_groups=4,
                                                          topk_groups=2, scaling_factor=2.5), ())}
    results = bench.run_ep(built_kernel_dir("moe-dispatch"), [2], models=tiny, tokens=(0, 8), variable_from=8,
                           device_type="cpu", timeout=RUN_TIMEOUT)
    by_case = {}
    for row in results["rows"]:
        by_case.setdefault(row["case"], {})[row["impl"]] = row
    assert sorted(by_case) == ["deepseek-v3 W=2 T=0", "deepseek-v3 W=2 T=8"]
    impls = {"single GPU", "torch._grouped_mm (local experts)", "ours (EP, capacity)", "all-to-all (capacity)",
             "single GPU / W + all-to-all (capacity)"}
    variable = {"ours (EP, variable)", "all-to-all (variable)", "single GPU / W + all-to-all (variable)"}
    assert set(by_case["deepseek-v3 W=2 T=0"]) == impls
    assert set(by_case["deepseek-v3 W=2 T=8"]) == impls | variable
    for impls_of_case in by_case.values():
        for row in impls_of_case.values():
            assert row["seconds"] > 0 and row["bytes"] >= 0
        for mode in ("capacity", "variable"):
            if f"ours (EP, {mode})" in impls_of_case:
                ours = impls_of_case[f"ours (EP, {mode})"]
                assert ours["dropped"] == 0 and ours["verified_rel_err"] <= 1e-2
    # the report renders the results file as it renders the single-GPU one
    page = report.markdown({**results, "name": bench.EP_RESULTS_NAME}, "plot.png")
    assert "ours (EP, variable)" in page and results["mode"] == "expert-parallel"


# ----------------------------------------------------------------------------------------------------
# On GPUs (NCCL, world size 1 on one GPU, 2 on two): the decode step captured in a CUDA graph
# ----------------------------------------------------------------------------------------------------


def _gpu_child(rank: int, world: int, built: str, tmp: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.distributed.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                                         device_id=device)
    try:
        from hubtools.build import load_build

        k = load_build(Path(built))
        E, Hg, Ig, top_k, T = 16, 256, 128, 4, 4
        g = torch.Generator(device=device).manual_seed(0)
        w_gate_up = (torch.randn(E, 2 * Ig, Hg, device=device, generator=g) / Hg**0.5).bfloat16()
        w_down = (torch.randn(E, Hg, Ig, device=device, generator=g) / Ig**0.5).bfloat16()
        router = torch.randn(E, Hg, device=device, generator=g) / Hg**0.5
        x = torch.randn(T, Hg, device=device, generator=torch.Generator(device=device).manual_seed(rank)).bfloat16()
        ep = k.ExpertParallel(capacity=T)
        shard = (ep.shard(w_gate_up), ep.shard(w_down))
        ref = k.moe_forward(x, router, w_gate_up, w_down, top_k)
        eager = k.moe_forward(x, router, *shard, top_k, expert_parallel=ep)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            k.moe_forward(x, router, *shard, top_k, expert_parallel=ep)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = k.moe_forward(x, router, *shard, top_k, expert_parallel=ep)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        ref_new = k.moe_forward(x, router, w_gate_up, w_down, top_k).float()

        def error(out, reference):
            return ((out.float() - reference.float()).norm() / reference.float().norm()).item()

        errors = {"eager": error(eager, ref), "graph": error(captured, ref_new), "dropped": ep.dropped_count()}
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(errors))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [
    pytest.param(1, marks=pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")),
    pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")),
])
def test_capacity_mode_in_a_cuda_graph_over_nccl(built_kernel_dir, tmp_path, world):
    """World size 1 runs on one GPU: the EP path's collectives and its graph capture over NCCL with every expert
    local; 2 ranks need 2 GPUs."""
    import torch.multiprocessing as mp

    context = mp.start_processes(_gpu_child, args=(world, str(built_kernel_dir("moe-dispatch")), str(tmp_path)),
                                 nprocs=world, join=False, start_method="spawn")
    _join(context, RUN_TIMEOUT)
    for rank in range(world):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert errors["eager"] <= 1e-2 and errors["graph"] <= 1e-2 and errors["dropped"] == 0, errors
