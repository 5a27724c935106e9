"""``rlkernels check --locate``: where stock PyTorch's per-token bits first drift in the check's model.

The check's model and sequences (see :mod:`rlkernels.check.model`) are run two ways
(by default one sequence at a time vs all in one right-padded batch, the check's
(a) and (b)) through :func:`rlkernels.check.locate_divergence`, once stock (the
model as loaded) and once patched (:func:`rlkernels.patch_model` under
:func:`rlkernels.set_batch_invariant_mode`). Stock names the first module whose
output for some token changes bits; rlkernels should name none.
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from ..integrations.aten_mode import set_batch_invariant_mode
from ..integrations.hf import patch_model
from . import model as model_check
from . import status
from .drift import DivergenceReport, locate_divergence


def _summary(report: DivergenceReport) -> dict:
    first, origin = report.first, report.origin
    return {"way_a": report.way_a, "way_b": report.way_b, "tokens": report.tokens,
            "first_divergent": dataclasses.asdict(first) if first else None,
            "origin": origin.name if origin else None,
            "divergent": [dataclasses.asdict(m) for m in report.divergent],
            "modules_compared": len(report.modules), "skipped": [list(s) for s in report.skipped]}


def run(device: str | None = None, dtype: str | None = None, seqs: int | None = None,
        model_path: str | None = None, *, way_a: str = "alone", way_b: str = "batch_right_padded",
        min_len: int | None = None, max_len: int | None = None, config_overrides: dict | None = None,
        console=None, cpu_threads: int | None = 1) -> dict:
    """Locate the first divergent module for stock and for rlkernels; print both; return the report.

    The report's "ok" is True when rlkernels' module outputs are all bitwise equal
    between the two ways. ``cpu_threads`` as in :func:`rlkernels.check.model.run`.
    """
    from rich.console import Console

    console = console or Console()
    dev = model_check.resolve_device(device)
    dt = model_check.resolve_dtype(dtype, dev)
    n = model_check.DEFAULT_SEQS if seqs is None else int(seqs)
    if n < 1:
        raise ValueError(f"rlkernels check --locate: seqs must be >= 1, got {seqs!r}")
    stock = model_check.build_model(dev, dt, model_path, config_overrides)
    lo = min_len or (4 if model_path is None else 16)
    hi = max_len or (48 if model_path is None else 256)
    sequences = [s.to(dev) for s in model_check.draw_sequences(n, int(stock.config.vocab_size), lo, max(lo, hi))]
    ours = patch_model(copy.deepcopy(stock))
    prev_threads = torch.get_num_threads()
    if dev.type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
    try:
        with status(console, "locating drift, stock..."):
            stock_report = locate_divergence(stock, sequences, way_a, way_b)
        with status(console, "locating drift, rlkernels..."), set_batch_invariant_mode(True):
            ours_report = locate_divergence(ours, sequences, way_a, way_b)
    finally:
        torch.set_num_threads(prev_threads)

    # Plain lines, not a rich table: module names are long and must print whole.
    console.print(f"[bold]drift locator[/]: {way_a} vs {way_b}, {n} sequences ({stock_report.tokens} tokens), "
                  f"{dev.type} {str(dt)[6:]}; first module (in the order forwards return) whose output "
                  "changes bits for some token:", soft_wrap=True)
    for name, rep in (("stock torch", stock_report), ("rlkernels", ours_report)):
        f, o = rep.first, rep.origin
        if f is None:
            line = "[green]none[/]"
        else:
            line = (f"[red]{f.name}[/] ({f.type}), {f.differing}/{f.tokens} tokens, max |Δ| {f.max_abs_diff:.2e}"
                    + (f"; bits change inside {o.name} ({o.type})" if o and o is not f else ""))
        console.print(f"  {name + ':':<13} {line}", soft_wrap=True, highlight=False)
    if stock_report.first is not None:
        console.print(stock_report.table(max_rows=8), markup=False, highlight=False, soft_wrap=True)
    if ours_report.first is not None:
        console.print(ours_report.table(), markup=False, highlight=False, soft_wrap=True)
    ok = ours_report.first is None
    console.print(f"rlkernels: {'[green]no module output differs[/]' if ok else '[red]DRIFT[/]'} "
                  f"between {way_a} and {way_b}.")
    return {"ok": ok, "device": str(dev), "dtype": str(dt)[6:], "seqs": n,
            "stock": _summary(stock_report), "rlkernels": _summary(ours_report)}
