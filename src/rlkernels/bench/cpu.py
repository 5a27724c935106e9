"""CPU benchmark: the torch backend (a reference path) against stock PyTorch, no GPU needed.

    rlkernels bench cpu [--json PATH] [--quick] [--repeats R] [--matmul M,K,N] [--logprob N,D,V]

Times, in seconds (wall clock, median of R rounds after one warm-up call each):
``rlkernels.matmul`` (torch backend, fp32) against ``a @ b``, and
``rlkernels.linear_logprob`` (torch backend, fp32) against a naive
``log_softmax(h @ W^T).gather(target)``. The torch backend builds every output
element as one ascending chain of single elementwise ops so that its bits do not
depend on the batch; it keeps the invariance contract, it is not a fast path, and
the ratios say by how much. Each round visits every variant in a rotating order,
so load from other processes on a shared machine spreads over all of them; the
JSON keeps every round's time and the load average.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch

from .common import print_table, write_json

NEEDS_CUDA = False

MATMUL_SHAPE = (256, 1024, 1024)  # M, K, N
LOGPROB_SHAPE = (128, 256, 8000)  # tokens, D, V
REPEATS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"timed rounds per variant, after one warm-up call (default {REPEATS})")
    parser.add_argument("--matmul", default=",".join(map(str, MATMUL_SHAPE)), metavar="M,K,N",
                        help="matmul shape (default %(default)s)")
    parser.add_argument("--logprob", default=",".join(map(str, LOGPROB_SHAPE)), metavar="N,D,V",
                        help="linear_logprob shape: tokens, hidden size, vocabulary (default %(default)s)")


def _shape(text: str, option: str) -> tuple[int, int, int]:
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise SystemExit(f"rlkernels bench cpu: {option} {text!r}: expected three positive integers like 256,1024,1024")
    return dims  # type: ignore[return-value]


def interleaved_median_s(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Every round's wall time in seconds per variant, after one warm-up call each.

    Rounds visit the variants in a rotating order, so a burst of load from another
    process lands on each variant about equally often; report the medians.
    """
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def _row(op: str, shape: str, times: dict[str, list[float]], ours: str, stock: str, **extra: Any) -> dict[str, Any]:
    t_ours, t_stock = statistics.median(times[ours]), statistics.median(times[stock])
    return {"op": op, "shape": shape, "dtype": "float32", "rlkernels_s": t_ours, "stock_s": t_stock,
            "ratio": t_ours / t_stock, "rlkernels_min_s": min(times[ours]), "stock_min_s": min(times[stock]),
            "rlkernels_times_s": times[ours], "stock_times_s": times[stock], **extra}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import rlkernels

    repeats = 3 if getattr(args, "quick", False) else getattr(args, "repeats", REPEATS)
    if repeats < 1:
        raise SystemExit(f"rlkernels bench cpu: --repeats {repeats}: expected a positive integer")
    M, K, N = _shape(getattr(args, "matmul", ",".join(map(str, MATMUL_SHAPE))), "--matmul")
    T, D, V = _shape(getattr(args, "logprob", ",".join(map(str, LOGPROB_SHAPE))), "--logprob")
    load_before = os.getloadavg()
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []

    a = torch.randn(M, K, generator=g)
    b = torch.randn(K, N, generator=g)
    ours = rlkernels.matmul(a, b, backend="torch")
    times = interleaved_median_s({"rlkernels": lambda: rlkernels.matmul(a, b, backend="torch"),
                                  "stock": lambda: a @ b}, repeats)
    rows.append(_row("matmul", f"{M}x{K}x{N}", times, "rlkernels", "stock",
                     # The contract, not speed, is what this path is for: a row alone gives the same bits.
                     row_invariant=torch.equal(rlkernels.matmul(a[-1:], b, backend="torch"), ours[-1:]),
                     max_abs_diff_vs_stock=(ours - a @ b).abs().max().item()))

    h = torch.randn(T, D, generator=g)
    w = torch.randn(V, D, generator=g) / D ** 0.5
    tgt = torch.randint(0, V, (T,), generator=g)

    def naive() -> torch.Tensor:
        return torch.log_softmax(h @ w.t(), dim=-1).gather(1, tgt[:, None])[:, 0]

    with torch.no_grad():
        ours = rlkernels.linear_logprob(h, w, tgt, backend="torch")
        times = interleaved_median_s({"rlkernels": lambda: rlkernels.linear_logprob(h, w, tgt, backend="torch"),
                                      "stock": naive}, repeats)
        alone = rlkernels.linear_logprob(h[-1:], w, tgt[-1:], backend="torch")
        rows.append(_row("linear_logprob", f"{T}x{D}x{V}", times, "rlkernels", "stock",
                         row_invariant=torch.equal(alone, ours[-1:]),
                         max_abs_diff_vs_stock=(ours - naive()).abs().max().item()))

    print_table(f"torch backend vs stock PyTorch on the CPU (seconds, median of {repeats} rounds)", rows,
                ["op", "shape", "dtype", "rlkernels_s", "stock_s", "ratio", "row_invariant"])
    for r in rows:
        print(f"{r['op']} {r['shape']}: rlkernels {r['rlkernels_s']:.3f} s, stock {r['stock_s']:.4f} s, "
              f"{r['ratio']:.0f}x stock")
    write_json(getattr(args, "json", None), "cpu", rows, {
        "cpu": {"model": _cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                "capability": torch.backends.cpu.get_cpu_capability(),
                "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "repeats": repeats,
    })
    return rows


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
