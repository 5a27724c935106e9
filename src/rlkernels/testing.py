"""The invariance test kit: check any function (ours or yours) row by row, bitwise.

All checks treat dim 0 of ``x`` as the batch of independent rows (tokens,
sequences) and ``fn`` as the code under test; ``fn`` may return a tensor or a
tuple/list of tensors whose dim 0 follows x's rows. Every comparison is of bit
patterns (so NaN equals the same NaN, and -0.0 differs from 0.0) -- a single flipped
bit fails -- and a failure names the rows that differ and by how much. Bad arguments
(sizes outside [0, len(x)], runs < 1, outputs that are not tensors with a row dim)
raise ValueError/TypeError, never pass silently.

    from rlkernels.testing import assert_batch_invariant
    assert_batch_invariant(lambda x: model_logprobs(x), tokens)

To find which module of a model first changes a token's bits, see the drift locator,
:func:`rlkernels.check.locate_divergence`.
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


_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as an integer tensor (same shape; complex gains a last dim of 2).

    ``torch.equal`` compares values, for which NaN != NaN and -0.0 == 0.0; the contract
    is about bits, so floats are compared as integers of the same width.
    """
    t = t.detach().resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_floating_point():
        return t.view(_INT_OF_WIDTH[t.element_size()])
    return t  # integer dtypes: the values are the bits


def _bits_equal(g: torch.Tensor, w: torch.Tensor) -> bool:
    return g.dtype == w.dtype and g.shape == w.shape and torch.equal(_bits(g), _bits(w))


_NEEDS = "a tensor or a tuple/list of tensors"


def _tensors(out: Any, check: str = "rlkernels.testing") -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o, check)]
    raise TypeError(f"{check}: fn must return {_NEEDS}, got {type(out).__name__}")


def _row_outputs(check: str, out: Any, n_rows: int) -> Any:
    """``out`` unchanged if it is tensors whose dim 0 has ``n_rows`` rows (x's); else TypeError."""
    for i, t in enumerate(_tensors(out, check)):
        label = f"output {i} " if not isinstance(out, torch.Tensor) else "its output "
        if t.dim() == 0:
            raise TypeError(f"{check}: fn must return {_NEEDS} with x's rows as dim 0 (dim 0 of row i is "
                            f"fn's result for x[i]); {label}is a 0-dim tensor")
        if t.shape[0] != n_rows:
            raise TypeError(f"{check}: fn must return {_NEEDS} with x's rows as dim 0; given {n_rows} rows, "
                            f"{label}has shape {tuple(t.shape)}")
    return out


def _call_rows(check: str, fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Any:
    return _row_outputs(check, fn(x), x.shape[0])


def _require_rows(check: str, x: Any) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{check}: x must be a tensor whose dim 0 is the batch of rows, got {type(x).__name__}")
    if x.dim() == 0:
        raise TypeError(f"{check}: x must have a row dim (dim 0), got a 0-dim tensor")
    if x.shape[0] == 0:
        raise ValueError(f"{check}: x has no rows (shape {tuple(x.shape)}): nothing to check")
    return x.shape[0]


def _require_int(check: str, name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{check}: {name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{check}: {name} must be {where}, got {value}")
    return value


def _row_report(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dim() == 0:
        return f"value {got.item()!r} != {want.item()!r} (compared bitwise)"
    n = got.shape[0]

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.flatten(1) if t.dim() > 1 else t[:, None]

    gb, wb = per_row(_bits(got)), per_row(_bits(want))
    bad_rows = (gb != wb).any(dim=1).nonzero().flatten().tolist()
    shown = bad_rows[:10]
    more = f" (+{len(bad_rows) - 10} more)" if len(bad_rows) > 10 else ""
    head = f"{len(bad_rows)} of {n} rows differ: {shown}{more}"
    g, w = per_row(got.detach()), per_row(want.detach())
    if g.is_complex():
        g, w = torch.view_as_real(g.resolve_conj()).flatten(1), torch.view_as_real(w.resolve_conj()).flatten(1)
    if g.is_floating_point():
        same = (g == w) | (torch.isnan(g) & torch.isnan(w))
    else:
        same = g == w
    if bool(same.all()):
        return f"{head}, in bits only (values compare equal: signed zeros or NaN payloads)"
    diff = (g.double() - w.double()).abs()
    diff = torch.where(same, torch.zeros_like(diff), diff).nan_to_num(nan=float("inf"))
    worst = int(diff.max(dim=1).values.argmax())
    return f"{head}; max |delta| = {diff.max().item():.3e} at row {worst}"


def _compare(what: str, got: Any, want: Any) -> None:
    gs, ws = _tensors(got), _tensors(want)
    if len(gs) != len(ws):
        raise InvarianceError(f"{what}: fn returned {len(gs)} tensors, expected {len(ws)}")
    for i, (g, w) in enumerate(zip(gs, ws)):
        if not _bits_equal(g, w):
            label = f" (output {i})" if len(gs) > 1 else ""
            reason = f"dtype {g.dtype} != {w.dtype}" if g.dtype != w.dtype else _row_report(g, w)
            raise InvarianceError(f"{what}{label}: {reason}")


def _rebuild(like: Any, items: list[Any]) -> Any:
    # namedtuples take their fields positionally; plain tuples and lists take an iterable.
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)


def _rows(out: Any, sl: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out[sl]
    return _rebuild(out, [_rows(o, sl) for o in out])


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=0)
    return _rebuild(parts[0], [_cat([p[i] for p in parts]) for i in range(len(parts[0]))])


def _default_sizes(n: int) -> list[int]:
    cand = {1, 2, 3, 7, 13, 16, 17, n // 2, n - 1, n}
    return sorted(m for m in cand if 1 <= m <= n)


def assert_batch_invariant(fn: Callable[[torch.Tensor], Any], x: torch.Tensor,
                           sizes: Sequence[int] | None = None) -> None:
    """Rows of ``fn(x[:m])`` equal ``fn(x)[:m]`` bitwise for every m in ``sizes``.

    ``x``: [n, ...] with n >= 1 rows; ``sizes``: prefix lengths in [0, n] (default: a
    spread of sizes up to n). ``fn`` returns a tensor or a tuple/list of tensors, each
    [rows, ...] with one dim-0 entry per row of its input.
    """
    check = "rlkernels.testing.assert_batch_invariant"
    n = _require_rows(check, x)
    if sizes is None:
        sizes = _default_sizes(n)
    else:
        sizes = list(sizes)
        if not sizes:
            raise ValueError(f"{check}: sizes is empty: nothing to check")
        for m in sizes:
            _require_int(check, f"sizes entry (x has {n} rows)", m, 0, n)
    full = _call_rows(check, fn, x)
    for m in sizes:
        _compare(f"batch invariance, first {m} of {n} rows", _call_rows(check, fn, x[:m]),
                 _rows(full, slice(0, m)))


def assert_chunk_invariant(fn: Callable[[torch.Tensor], Any], x: torch.Tensor,
                           chunks: Sequence[int] | None = None, seed: int = 0) -> None:
    """``fn`` over consecutive chunks (chunked-prefill style) equals ``fn(x)`` bitwise.

    ``chunks``: chunk lengths (each >= 0) summing to len(x); default: random lengths.
    """
    check = "rlkernels.testing.assert_chunk_invariant"
    n = _require_rows(check, x)
    if chunks is None:
        g = torch.Generator().manual_seed(seed)
        chunks, left = [], n
        while left:
            c = int(torch.randint(1, max(2, n // 3 + 1), (1,), generator=g))
            chunks.append(min(c, left))
            left -= chunks[-1]
    chunks = list(chunks)
    for c in chunks:
        _require_int(check, "chunks entry", c, 0)
    if sum(chunks) != n:
        raise ValueError(f"{check}: chunks {chunks} sum to {sum(chunks)}, not len(x) = {n}")
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    parts = [_call_rows(check, fn, x[s:s + c]) for s, c in zip(starts, chunks) if c]
    _compare(f"chunk invariance, chunks {chunks}", _cat(parts), _call_rows(check, fn, x))


def assert_padding_invariant(fn: Callable[[torch.Tensor], Any], x: torch.Tensor,
                             before: int = 3, after: int = 5, seed: int = 0) -> None:
    """Surrounding ``x`` with other rows (random data) leaves x's rows unchanged.

    ``before``/``after``: how many rows (each >= 0) go before and after x.
    """
    check = "rlkernels.testing.assert_padding_invariant"
    n = _require_rows(check, x)
    _require_int(check, "before", before, 0)
    _require_int(check, "after", after, 0)
    g = torch.Generator().manual_seed(seed)

    def junk(k: int) -> torch.Tensor:
        if x.is_floating_point():
            return torch.randn((k,) + tuple(x.shape[1:]), generator=g, dtype=torch.float32).to(x)
        lo, hi = int(x.min()) if x.numel() else 0, int(x.max()) + 1 if x.numel() else 1
        return torch.randint(lo, hi, (k,) + tuple(x.shape[1:]), generator=g).to(x)

    padded = torch.cat([junk(before), x, junk(after)], dim=0)
    _compare(f"padding invariance ({before} rows before, {after} after)",
             _rows(_call_rows(check, fn, padded), slice(before, before + n)), _call_rows(check, fn, x))


def assert_order_invariant(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, seed: int = 0) -> None:
    """Shuffling the rows shuffles the outputs and changes nothing else."""
    check = "rlkernels.testing.assert_order_invariant"
    n = _require_rows(check, x)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(x.device)
    full = _call_rows(check, fn, x)
    _compare("row-order invariance", _call_rows(check, fn, x[perm]), _rows(full, perm))


def output_hash(out: Any) -> str:
    """SHA-256 over the bytes, dtypes and shapes of every output tensor."""
    h = hashlib.sha256()
    for t in _tensors(out, "rlkernels.testing.output_hash"):
        t = t.detach().resolve_conj().resolve_neg().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        # reshape(-1): a 0-dim tensor cannot be viewed as bytes of another width.
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
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
    the children inherit the environment (backend, interpreter flags). ``runs`` >= 1
    (with 1, only the cross-process check compares anything), ``processes`` >= 0. ``fn``
    returns a tensor or a tuple/list of tensors (any shapes). Returns the hash.
    """
    check = "rlkernels.testing.assert_deterministic"
    _require_int(check, "runs", runs, 1)
    _require_int(check, "processes", processes, 0)
    if runs == 1 and processes == 0:
        raise ValueError(f"{check}: runs=1 with processes=0 compares nothing; use runs >= 2 or processes >= 1")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{check}: x must be a tensor, got {type(x).__name__}")
    first = fn(x)
    _tensors(first, check)
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

