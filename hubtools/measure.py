"""The measurement protocol shared by the kernel benchmarks (bench/) and the whole-model runs (e2e/,
examples/smollm2.py); see CONTRIBUTING.md.

- Device ceilings are measured in the same run: copy bandwidth eagerly with events (a copy captured
  in a CUDA graph runs on the copy engines and under-reads the ceiling), bf16 matmul FLOP/s.
- Kernels are timed by CUDA-graph replay: many calls captured in one graph, each call on the next
  of a set of rotated inputs so that the working set is far larger than L2 and every call streams from HBM.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

import torch

L2_FLUSH_BYTES = 400 * 2**20  # rotate through at least this many bytes of distinct inputs


def warm_clocks(seconds: float = 0.5) -> None:
    """Run bf16 matmuls for a while so clocks are up before anything is timed."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


def _event_time(fn: Callable[[], object], iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure_copy_bandwidth(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write, eager with events."""
    src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    t = min(_event_time(lambda: dst.copy_(src), 20) for _ in range(3))
    return 2 * nbytes / t


def measure_matmul_flops(n: int = 8192) -> float:
    """Dense bf16 n^3 matmul throughput in FLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = min(_event_time(lambda: a @ a, 20) for _ in range(3))
    return 2 * n**3 / t


def rotation_count(bytes_per_call: int, min_copies: int = 2, max_copies: int = 64) -> int:
    """How many distinct input sets to rotate through so their total exceeds L2_FLUSH_BYTES."""
    need = -(-L2_FLUSH_BYTES // max(bytes_per_call, 1))
    return int(min(max(need, min_copies), max_copies))


def _captured(fn: Callable[[int], object], n_inputs: int, calls: int) -> torch.cuda.CUDAGraph:
    """`calls` calls of `fn(i)` captured in one graph (after a warm-up on a side stream) and replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(n_inputs, 3) + 1):
            fn(i % n_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % n_inputs)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _replay_seconds(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_graph(
    fn: Callable[[int], object], n_inputs: int, *, calls: int | None = None, replays: int = 5
) -> float:
    """Seconds per call of `fn(i)` (i indexes the rotated inputs), by CUDA-graph replay.

    `calls` calls (default: enough to cycle the inputs at least twice, at least 20) are captured in one
    graph after a warm-up on a side stream; the graph is replayed `replays` times and the best replay
    is divided by `calls`.
    """
    calls = calls or max(20, 2 * n_inputs)
    graph = _captured(fn, n_inputs, calls)
    best = min(_replay_seconds(graph) for _ in range(replays))
    del graph
    return best / calls


def time_graphs_interleaved(
    fns: Sequence[Callable[[int], object]], n_inputs: int, *, calls: int | None = None, rounds: int = 5
) -> list[list[float]]:
    """Seconds per call of each of `fns`, once a round for `rounds` rounds (``[fn][round]``), as `time_graph`
    captures them. Each round replays every graph once, starting one further along each round, so that clock and
    heat drift over the run fall on all of them alike: a difference of a few percent between launches timed one
    after the other is otherwise not evidence (docs/design/w4a16.md, run 135)."""
    calls = calls or max(20, 2 * n_inputs)
    graphs = [_captured(fn, n_inputs, calls) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for j in range(len(fns)):
            i = (r + j) % len(fns)
            times[i].append(_replay_seconds(graphs[i]) / calls)
    del graphs
    return times


class ClockLog:
    """The GPU's SM clock, power draw and clock-limit reasons (a hex mask; 0x4 is the power cap) sampled by
    ``nvidia-smi`` every `interval_ms` while the block runs; `between` gives the samples of a span of
    ``time.time()``. The sampler writes to a file: a pipe nobody reads until the end fills and stops it."""

    FIELDS = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"

    def __init__(self, interval_ms: int = 20):
        self.interval_ms = interval_ms
        self.samples: list[dict] = []

    def __enter__(self) -> "ClockLog":
        self._file = tempfile.TemporaryFile("w+")
        self._process = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                          "-lms", str(self.interval_ms)], stdout=self._file, text=True)
        return self

    def __exit__(self, *exc) -> None:
        self._process.terminate()
        self._process.wait()
        self._file.seek(0)
        self.samples = parse_clock_samples(self._file.read())
        self._file.close()

    def between(self, start: float, end: float) -> list[dict]:
        return [s for s in self.samples if start <= s["t"] <= end]


def kernel_times(fn: Callable[[int], object], n_inputs: int, calls: int = 50) -> dict[str, float]:
    """{CUDA kernel name: mean microseconds per call} of `fn(i)` called eagerly (i cycling over `n_inputs`),
    by torch.profiler: where one call's time goes, kernel by kernel (eager, so without the overlap of dependent
    launches that graph replay has)."""
    for i in range(5):
        fn(i % n_inputs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i % n_inputs)
        torch.cuda.synchronize()
    total: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] = total.get(event.name, 0.0) + event.device_time
    return {name: t / calls for name, t in total.items()}


def parse_clock_samples(text: str) -> list[dict]:
    """`ClockLog`'s nvidia-smi lines (``2026/12/06 18:08:07.123, 1455, 690.53, 0x0000000000000004``) as dicts with
    ``t`` in ``time.time()`` seconds (nvidia-smi stamps local time, as ``time.mktime`` reads it); lines with a
    field the driver could not read (``[N/A]``) are left out."""
    samples = []
    for line in text.splitlines():
        fields = [v.strip() for v in line.split(",")]
        if len(fields) != 4:
            continue
        stamp, sm, power, reasons = fields
        whole, _, fraction = stamp.partition(".")
        try:
            t = time.mktime(time.strptime(whole, "%Y/%m/%d %H:%M:%S")) + float("0." + (fraction or "0"))
            samples.append({"t": t, "sm_mhz": int(sm), "power_w": float(power), "reasons": reasons})
        except ValueError:
            continue
    return samples


def sustained_replays(fn: Callable[[int], object], n_inputs: int, seconds: float, *,
                      calls: int = 20) -> list[tuple[float, float]]:
    """(seconds since the start, seconds per call) of each replay of `calls` calls of `fn(i)` (captured as
    `time_graph` does), replayed back to back for `seconds`: how a kernel runs once the card's power and heat
    limits have set its clocks, where `time_graph`'s best replay reads the first milliseconds."""
    graph = _captured(fn, n_inputs, calls)
    replays = []
    start = time.time()
    while time.time() - start < seconds:
        replays.append((time.time() - start, _replay_seconds(graph) / calls))
    del graph
    return replays


def environment(command: Sequence[str] | None = None, device: torch.device | str | None = None) -> dict:
    """Device, date, versions and the command: stamped on every results file and figure. `device`: where
    the run ran (default: the first GPU if there is one); "gpu" says "cpu" for CPU runs."""
    try:
        import triton  # noqa: PLC0415  (absent from the torch-cpu world is fine)

        triton_version = triton.__version__
    except ImportError:
        triton_version = None

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {
        "gpu": props.name if props else "cpu",
        "sm_count": props.multi_processor_count if props else None,
        "cpu_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "transformers": version("transformers"),
        "kernels": version("kernels"),
        "python": platform.python_version(),
        "command": "python " + " ".join(_portable(arg) for arg in (command if command is not None else sys.argv)),
    }


def _portable(arg: str) -> str:
    """A command-line argument without this machine's paths: absolute paths relative to the working
    directory where they lie inside it, else their file name."""
    if not os.path.isabs(arg):
        return arg
    cwd = os.getcwd()
    return os.path.relpath(arg, cwd) if os.path.commonpath([arg, cwd]) == cwd else os.path.basename(arg)
