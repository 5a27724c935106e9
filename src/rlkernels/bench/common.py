"""Shared benchmark plumbing: device-event medians, environment record, JSON, tables.

Performance lives here, not in tests: every benchmark times with
``triton.testing.do_bench`` (CUDA events, warm-up, median) -- or CUDA-graph
replay for launch-bound ops -- puts stock cuBLAS (torch) and any installed peer
in the same run, and writes JSON with the device and library versions.
"""
from __future__ import annotations

import datetime
import importlib
import itertools
import json
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable

import torch

from .._versions import installed_version


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    for mod in ("triton", "rlkernels", "transformers", "liger_kernel", "cut_cross_entropy", "sgemm_bi"):
        env[mod] = installed_version(mod)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["sm_count"] = p.multi_processor_count
        env["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
    return env


def optional_import(name: str) -> Any | None:
    """A peer library if installed, else None (benchmarks run without peers)."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def median_ms(fn: Callable[[], Any], warmup_ms: int = 50, rep_ms: int = 200) -> float:
    """Median time of ``fn`` in ms by CUDA events after warm-up."""
    import triton.testing

    # do_bench sizes its loops from one first call; a first call that JIT-compiles
    # would leave it timing one or two cold calls. Compile and warm caches first.
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def fixed_call_times_ms(fn: Callable[[], Any], reps: int, cuda: bool) -> list[float]:
    """``reps`` timed calls of ``fn`` in ms, each alone: CUDA events around it on a GPU, the
    wall clock on the CPU. A fixed count, unlike do_bench's: every process of a
    distributed benchmark then makes the same collectives."""
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def interleaved_median_ms(fns: dict[str, Callable[[], Any]], rounds: int = 5, warmup_ms: int = 10,
                          rep_ms: int = 40) -> dict[str, float]:
    """Each ``fn``'s median time in ms, measured in alternating rounds.

    Timing one variant after another lets clock and temperature drift between them
    (single large-M calls moved by up to 12% within a run); rounds that visit every
    variant in turn, in a rotating order, share the drift out. The result is the median
    of the per-round medians.
    """
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    # Every variant takes every place in a round equally often (rounds rounded up to a
    # multiple of the variant count): later places ran up to 1.5% slower at compute-bound
    # points, and 5 rounds of 4 variants put the last two one place later in the median
    # round (H100; docs/design/measurement.md).
    rounds = -(-rounds // len(names)) * len(names) if names else 0
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(median_ms(fns[name], warmup_ms=warmup_ms, rep_ms=rep_ms))
    return {name: statistics.median(ts) for name, ts in times.items()}


def host_median_us(fn: Callable[[], Any], calls: int = 20, trials: int = 21) -> float:
    """Median host µs per call of ``fn`` (Python, launch), the GPU never the slower side.

    Short bursts after a synchronize stay far below the launch queue's depth, so no
    call waits for the GPU. Where this approaches the GPU time per ``do_bench``
    iteration (its L2 flush plus the call), eager timings include host time.
    """
    import time

    for _ in range(3):
        fn()
    times = []
    for _ in range(trials):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def graph_median_us(fn: Callable[[], Any], replays: int = 200, trials: int = 15) -> float:
    """Median per-call time in µs from CUDA-graph replays of ``fn`` (for launch-bound ops)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / replays)
    times.sort()
    return times[len(times) // 2]


def l2_cold_copies(t: torch.Tensor, total_bytes: int = 512 << 20) -> list[torch.Tensor]:
    """Copies of ``t`` totalling at least ``total_bytes`` (10x an H100's 50 MB L2).

    Decode runs every layer's weight once per step, so a weight is read from HBM; a
    benchmark that calls one weight back to back reads it from L2 when it fits there.
    """
    copies = -(-total_bytes // max(1, t.numel() * t.element_size()))
    return [t] + [t.clone() for _ in range(copies - 1)]


def cycling(fn_of: Callable[[Any], Any], items: list[Any]) -> Callable[[], Any]:
    """A no-argument ``fn_of(item)`` that takes the next item on every call."""
    it = itertools.cycle(items)
    return lambda: fn_of(next(it))


def peak_extra_memory_gib(fn: Callable[[], Any]) -> float:
    """Peak device memory allocated during ``fn`` beyond what was allocated before, GiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def write_json(path: str | None, name: str, rows: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
    if not path:
        return
    """The layout of benchmarks/results/README.md: the suite, the command line that ran it,
    the environment (date, device, versions), the rows, then any suite-specific keys."""
    doc = {"benchmark": name, "command": shlex.join(sys.argv), "environment": environment(), "rows": rows,
           **(extra or {})}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*[_fmt(r.get(c)) for c in columns])
    Console(width=200).print(table)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def only_arg(value: str, workloads: tuple[str, ...]) -> tuple[str, ...]:
    """``--only a,b``: the named workloads, each one of ``workloads`` (argparse's error otherwise)."""
    import argparse

    names = tuple(n.strip() for n in value.split(",") if n.strip())
    bad = [n for n in names if n not in workloads]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {', '.join(map(repr, bad)) or repr(value)}; "
                                         f"expected a comma-separated list of {', '.join(workloads)}")
    return names
