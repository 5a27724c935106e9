"""Op-level part of ``rlkernels check``: the invariance kit over every registered op."""
from __future__ import annotations

from typing import Any

import torch

from .. import testing
from ..registry import implementation, registered_ops, select_backend

CHECKS = ("batch", "chunk", "padding", "order", "determinism")


def _run_checks(fn, x) -> dict[str, str]:
    results = {}
    kit = {
        "batch": lambda: testing.assert_batch_invariant(fn, x),
        "chunk": lambda: testing.assert_chunk_invariant(fn, x),
        "padding": lambda: testing.assert_padding_invariant(fn, x[: max(1, x.shape[0] // 2)]),
        "order": lambda: testing.assert_order_invariant(fn, x),
        "determinism": lambda: testing.assert_deterministic(fn, x, runs=2),
    }
    for name, check in kit.items():
        try:
            check()
            results[name] = "ok"
        except testing.InvarianceError as e:
            results[name] = f"FAIL: {e}"
    return results


def op_check_rows(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> list[dict[str, Any]]:
    """One row per (op, dtype): which backend ran and each check's outcome."""
    rows = []
    for op in registered_ops():
        backend, why = select_backend(op, device)
        impl = implementation(op, backend)().to(device)
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
            with torch.no_grad():
                row.update(_run_checks(fn, x))
            rows.append(row)
    return rows


def rows_ok(rows: list[dict[str, Any]]) -> bool:
    """Every op ran every check and passed (a dtype an op doesn't support is skipped)."""
    for r in rows:
        if r.get("error", "").startswith("skipped"):
            continue
        if "error" in r or any(r.get(c) != "ok" for c in CHECKS):
            return False
    return True
