"""The invariance test kit: check any function (ours or yours) row by row, bitwise.

All checks treat dim 0 of ``x`` as the batch of independent rows (tokens,
sequences) and ``fn`` as the code under test; ``fn`` may return a tensor or a
tuple/list of tensors whose dim 0 follows x's rows. Every comparison is
``torch.equal`` -- a single flipped bit fails -- and a failure names the rows that
differ and by how much.

    from rlkernels.testing import assert_batch_invariant
    assert_batch_invariant(lambda x: model_logprobs(x), tokens)
"""
from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "InvarianceError",
    "assert_batch_invariant",
    "assert_chunk_invariant",
    "assert_padding_invariant",
    "assert_order_invariant",
    "assert_deterministic",
    "rel_error",
    "output_hash",
]


class InvarianceError(AssertionError):
    """A row's bits changed with its batch context (or between runs)."""


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    raise TypeError(f"rlkernels.testing: fn must return tensors, got {type(out).__name__}")


def _row_report(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dim() == 0:
        return f"value {got.item()!r} != {want.item()!r}"
    g, w = got.reshape(got.shape[0], -1), want.reshape(want.shape[0], -1)
    same = (g == w) | (torch.isnan(g) & torch.isnan(w)) if g.is_floating_point() else (g == w)
    bad_rows = (~same).any(dim=1).nonzero().flatten().tolist()
    if not bad_rows:
        return "equal values but different bits (e.g. signed zeros or NaN payloads)"
    diff = (g.double() - w.double()).abs()
    diff = torch.where(same, torch.zeros_like(diff), diff).nan_to_num(nan=float("inf"))
    worst = int(diff.max(dim=1).values.argmax())
    shown = bad_rows[:10]
    more = f" (+{len(bad_rows) - 10} more)" if len(bad_rows) > 10 else ""
    return (f"{len(bad_rows)} of {g.shape[0]} rows differ: {shown}{more}; "
            f"max |delta| = {diff.max().item():.3e} at row {worst}")


def _compare(what: str, got: Any, want: Any) -> None:
    gs, ws = _tensors(got), _tensors(want)
    if len(gs) != len(ws):
        raise InvarianceError(f"{what}: fn returned {len(gs)} tensors, expected {len(ws)}")
    for i, (g, w) in enumerate(zip(gs, ws)):
        if g.dtype != w.dtype or not torch.equal(g, w):
            label = f" (output {i})" if len(gs) > 1 else ""
            reason = f"dtype {g.dtype} != {w.dtype}" if g.dtype != w.dtype else _row_report(g, w)
            raise InvarianceError(f"{what}{label}: {reason}")


def _rows(out: Any, sl: slice) -> Any:
    if isinstance(out, torch.Tensor):
        return out[sl]
    return type(out)(_rows(o, sl) for o in out)


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=0)
    return type(parts[0])(_cat([p[i] for p in parts]) for i in range(len(parts[0])))


def _default_sizes(n: int) -> list[int]:
    cand = {1, 2, 3, 7, 13, 16, 17, n // 2, n - 1, n}
    return sorted(m for m in cand if 1 <= m <= n)


def assert_batch_invariant(fn: Callable[[torch.Tensor], Any], x: torch.Tensor,
                           sizes: Sequence[int] | None = None) -> None:
    """Rows of ``fn(x[:m])`` equal ``fn(x)[:m]`` bitwise for every m in ``sizes``."""
    full = fn(x)
    for m in sizes if sizes is not None else _default_sizes(x.shape[0]):
        _compare(f"batch invariance, first {m} of {x.shape[0]} rows", fn(x[:m]), _rows(full, slice(0, m)))


def assert_chunk_invariant(fn: Callable[[torch.Tensor], Any], x: torch.Tensor,
                           chunks: Sequence[int] | None = None, seed: int = 0) -> None:
    """``fn`` over consecutive chunks (chunked-prefill style) equals ``fn(x)`` bitwise.

    ``chunks``: chunk lengths summing to len(x); default: random lengths.
    """
    n = x.shape[0]
    if chunks is None:
        g = torch.Generator().manual_seed(seed)
        chunks, left = [], n
        while left:
            c = int(torch.randint(1, max(2, n // 3 + 1), (1,), generator=g))
            chunks.append(min(c, left))
            left -= chunks[-1]
    if sum(chunks) != n:
        raise ValueError(f"chunks {list(chunks)} sum to {sum(chunks)}, not {n}")
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    parts = [fn(x[s:s + c]) for s, c in zip(starts, chunks) if c]
    _compare(f"chunk invariance, chunks {list(chunks)}", _cat(parts), fn(x))


def assert_padding_invariant(fn: Callable[[torch.Tensor], Any], x: torch.Tensor,
                             before: int = 3, after: int = 5, seed: int = 0) -> None:
    """Surrounding ``x`` with other rows (random data) leaves x's rows unchanged."""
    g = torch.Generator().manual_seed(seed)

    def junk(k: int) -> torch.Tensor:
        if x.is_floating_point():
            return torch.randn((k,) + tuple(x.shape[1:]), generator=g, dtype=torch.float32).to(x)
        lo, hi = int(x.min()) if x.numel() else 0, int(x.max()) + 1 if x.numel() else 1
        return torch.randint(lo, hi, (k,) + tuple(x.shape[1:]), generator=g).to(x)

    padded = torch.cat([junk(before), x, junk(after)], dim=0)
    _compare(f"padding invariance ({before} rows before, {after} after)",
             _rows(fn(padded), slice(before, before + x.shape[0])), fn(x))


def assert_order_invariant(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, seed: int = 0) -> None:
    """Shuffling the rows shuffles the outputs and changes nothing else."""
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed)).to(x.device)
    full = fn(x)

    def take(o: Any) -> Any:
        return o[perm] if isinstance(o, torch.Tensor) else type(o)(take(t) for t in o)

    _compare("row-order invariance", fn(x[perm]), take(full))


def output_hash(out: Any) -> str:
    """SHA-256 over the bytes, dtypes and shapes of every output tensor."""
    h = hashlib.sha256()
    for t in _tensors(out):
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _callable_path(fn: Callable) -> str:
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qual or module == "__main__":
        raise ValueError("rlkernels.testing.assert_deterministic(processes>0) needs a module-level function "
                         f"(importable by name); got {fn!r}")
    return f"{module}:{qual}"


_CHILD = r"""
import importlib, pickle, sys, torch
from rlkernels.testing import output_hash
mod, qual = sys.argv[1].split(":")
fn = importlib.import_module(mod)
for part in qual.split("."):
    fn = getattr(fn, part)
with open(sys.argv[2], "rb") as f:
    x = pickle.load(f)
print(output_hash(fn(x)))
"""


def assert_deterministic(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, runs: int = 3,
                         processes: int = 0) -> str:
    """``fn(x)`` gives identical bits on every run, and in ``processes`` fresh processes.

    For ``processes > 0``, ``fn`` must be importable by name (a module-level function);
    the children inherit the environment (backend, interpreter flags). Returns the hash.
    """
    first = fn(x)
    want = output_hash(first)
    for i in range(1, runs):
        _compare(f"run-to-run determinism, run {i + 1}", fn(x), first)
    if processes:
        path = _callable_path(fn)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        with tempfile.TemporaryDirectory() as d:
            blob = os.path.join(d, "x.pkl")
            with open(blob, "wb") as f:
                pickle.dump(x.detach().cpu() if x.device.type != "cuda" else x.detach(), f)
            for p in range(processes):
                res = subprocess.run([sys.executable, "-c", _CHILD, path, blob], capture_output=True, text=True, env=env)
                if res.returncode != 0:
                    raise RuntimeError(f"determinism child process failed:\n{res.stderr[-2000:]}")
                got = res.stdout.strip().splitlines()[-1]
                if got != want:
                    raise InvarianceError(f"cross-process determinism: process {p + 1} hashed {got[:16]}…, "
                                          f"this process {want[:16]}…")
    return want


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (0 when both are 0; inf on NaN)."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if torch.isnan(o).any() and not torch.isnan(r).any():
        return float("inf")
    num, den = (o - r).norm().item(), r.norm().item()
    return num / den if den else (0.0 if num == 0 else float("inf"))
