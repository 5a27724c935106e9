"""Op-level part of ``rlkernels check``: the invariance kit over every registered op."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from .. import testing
from .._env import triton_interpret
from ..registry import BackendUnavailableError, implementation, registered_ops, select_backend

CHECKS = ("batch", "chunk", "padding", "order", "determinism")


def _kit(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Each check of the invariance kit on ``fn`` and its rows ``x``, by name."""
    return {
        "batch": lambda: testing.assert_batch_invariant(fn, x),
        "chunk": lambda: testing.assert_chunk_invariant(fn, x),
        "padding": lambda: testing.assert_padding_invariant(fn, x[: max(1, x.shape[0] // 2)]),
        "order": lambda: testing.assert_order_invariant(fn, x),
        "determinism": lambda: testing.assert_deterministic(fn, x, runs=2),
    }


def _run_checks(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> dict[str, str]:
    results = {}
    for name, check in _kit(fn, x).items():
        try:
            check()
            results[name] = "ok"
        except testing.InvarianceError as e:
            results[name] = f"FAIL: {e}"
    return results


def _selected(device: torch.device) -> list[tuple[str, str, str, Any]]:
    """(op, backend, why, implementation on ``device``) for every registered op."""
    out = []
    for op in registered_ops():
        backend, why = select_backend(op, device)
        out.append((op, backend, why, implementation(op, backend)().to(device)))
    return out


def op_check_rows(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> list[dict[str, Any]]:
    """One row per (op, dtype): which backend ran and each check's outcome.

    A dtype an op or its backend does not take (the op's own ValueError, or a backend
    that refuses it by design, such as bfloat16 on the Triton backend under
    ``TRITON_INTERPRET=1``) gives a row whose "error" starts with "skipped:" and says why.
    """
    rows = []
    for op, backend, why, impl in _selected(device):
        for dtype in dtypes:
            row: dict[str, Any] = {"op": op, "backend": backend, "why": why, "dtype": str(dtype).replace("torch.", "")}
            try:
                fn, x = impl.invariance_case(device, dtype, torch.Generator().manual_seed(0))
            except NotImplementedError:
                row["error"] = "no invariance case"
                rows.append(row)
                continue
            except ValueError as e:  # dtype not supported by this op
                row["error"] = f"skipped: {e}"
                rows.append(row)
                continue
            try:
                with torch.no_grad():
                    row.update(_run_checks(fn, x))
            except BackendUnavailableError as e:
                row["error"] = f"skipped: {e}"
            rows.append(row)
    return rows


def default_compile_workers() -> int:
    """Threads for :func:`warm_up`: one per core, at most 16."""
    return max(1, min(16, os.cpu_count() or 1))


def warm_up(device: torch.device, dtypes: tuple[torch.dtype, ...], workers: int) -> int:
    """Run the op table's checks once in ``workers`` threads, outcomes discarded; returns the task count.

    What makes the op table slow on a cold GPU is Triton compiling each kernel variant
    it launches (one per constexpr set and integer specialization: the kit calls each op
    with many row counts), one after another. Triton's compile releases the GIL in its
    MLIR passes and waits on ptxas and the C compiler as subprocesses, so compiles in
    threads overlap. Each task is one check of one (op, dtype); the table itself then
    comes from :func:`op_check_rows`' sequential pass over warm caches, so threads never
    decide a reported outcome. Nothing to warm (0 tasks) on the CPU, under
    ``TRITON_INTERPRET=1``, with ``workers`` < 2, or where no op runs on Triton.
    """
    if device.type != "cuda" or triton_interpret() or workers < 2:
        return 0
    tasks: list[tuple[Any, torch.dtype, str]] = [
        (impl, dtype, check) for _, backend, _, impl in _selected(device) if backend == "triton"
        for dtype in dtypes for check in CHECKS if check != "determinism"]  # determinism runs what the others run

    index = device.index if device.index is not None else torch.cuda.current_device()

    def run(task: tuple[Any, torch.dtype, str]) -> None:
        impl, dtype, check = task
        # Grad mode and the current CUDA device are per thread.
        with torch.cuda.device(index), torch.no_grad():
            try:
                fn, x = impl.invariance_case(device, dtype, torch.Generator().manual_seed(0))
                _kit(fn, x)[check]()
            except Exception:  # noqa: BLE001 - the sequential pass reports every failure
                pass

    if tasks:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rlkernels-warm-up") as pool:
            list(pool.map(run, tasks))
        torch.cuda.synchronize(device)
    return len(tasks)


def rows_ok(rows: list[dict[str, Any]]) -> bool:
    """Every op ran every check and passed (a dtype an op doesn't support is skipped)."""
    for r in rows:
        if r.get("error", "").startswith("skipped"):
            continue
        if "error" in r or any(r.get(c) != "ok" for c in CHECKS):
            return False
    return True
