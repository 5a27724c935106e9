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

:func:`locate_divergence` (the drift locator) runs a model's tokens two ways and names
the first module whose per-token output changes bits (docs/operators/drift_locator.md).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
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
    "locate_divergence",
    "Way",
    "ModuleDrift",
    "DivergenceReport",
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


# ---------------------------------------------------------------- the drift locator

_LOCATE = "rlkernels.testing.locate_divergence"


@dataclass(frozen=True)
class Way:
    """One way to run a set of tokens through a model: forward passes and where each token lands.

    ``runs``: ``(run, token_map)`` pairs. ``run()`` runs the model once (any call that
    reaches the hooked modules: ``model(...)``, ``model.generate(...)``, a trainer's
    scoring function); ``token_map`` is an integer tensor [B, L] giving, for row b and
    position t of every per-token module output of that run ([B, L, ...]), the token's
    identity (any integer >= 0, shared by both ways), or -1 where the position is not
    a token to compare (padding). Each identity appears at most once in a way.
    """

    name: str
    runs: Sequence[tuple[Callable[[], Any], torch.Tensor]]


@dataclass(frozen=True)
class ModuleDrift:
    """One module output compared token by token between the two ways.

    ``name`` is the module's qualified name (``(model)`` for the model itself), with
    ``#k`` appended for its k-th call (k >= 2) within one forward pass; ``order`` is
    its place in execution order (when its forward returned, so a layer comes after
    the modules inside it). ``input_differs``: whether the module's first tensor input
    already differed for some token (None when that input is not per-token): a
    divergent module with an equal input is where the bits change; one with a
    differing input received them changed from code outside any hooked module.
    """

    name: str
    type: str
    order: int
    tokens: int
    differing: int
    max_abs_diff: float
    input_differs: bool | None = None

    @property
    def differs(self) -> bool:
        return self.differing > 0

    @property
    def fraction(self) -> float:
        """Share of the compared tokens whose output bits differ."""
        return self.differing / self.tokens if self.tokens else 0.0


@dataclass
class DivergenceReport:
    """What :func:`locate_divergence` found: every compared module output, in execution order."""

    way_a: str
    way_b: str
    tokens: int
    modules: list[ModuleDrift]
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def divergent(self) -> list[ModuleDrift]:
        """Every module whose output differs for some token, in execution order."""
        return [m for m in self.modules if m.differs]

    @property
    def first(self) -> ModuleDrift | None:
        """The first module in execution order whose output differs (None: all bitwise equal)."""
        div = self.divergent
        return div[0] if div else None

    @property
    def origin(self) -> ModuleDrift | None:
        """The first divergent module whose input was bitwise equal: the bits change inside it.

        Forwards return inner modules first, so this is the innermost hooked module that
        contains the change (None when nothing differs or no divergent module's input
        could be compared).
        """
        return next((m for m in self.divergent if m.input_differs is False), None)

    def table(self, all_modules: bool = False, max_rows: int | None = 40) -> str:
        """A fixed-width text table of the divergent modules (every compared one with ``all_modules``).

        ``max_rows`` caps the rows shown (None: all); the skipped modules follow, with why.
        """
        rows = self.modules if all_modules else self.divergent
        first = self.first
        lines = [f"drift locator: {self.way_a} vs {self.way_b}: {self.tokens} tokens, "
                 f"{len(self.modules)} module outputs compared bitwise, {len(self.skipped)} skipped",
                 "first divergent module: " + (f"{first.name} ({first.type}), {first.differing}/{first.tokens} "
                                               f"tokens, max |delta| {first.max_abs_diff:.3e}" if first else "none")]
        origin = self.origin
        if first is not None and first.input_differs:
            lines.append("  its input already differs: the bits changed in code outside any hooked module"
                         + (f"; the first divergent module with an equal input is {origin.name} ({origin.type})"
                            if origin else ""))
        if rows:
            shown = rows if max_rows is None else rows[:max_rows]
            nw = max(len("module"), *(len(m.name) for m in shown))
            tw = max(len("type"), *(len(m.type) for m in shown))
            lines.append(f"{'#':>4}  {'module':<{nw}}  {'type':<{tw}}  {'input':<7}  {'tokens differing':>20}  "
                         f"{'max |delta|':>11}")
            for m in shown:
                mark = "  <- first" if m is first else ""
                inp = {None: "-", True: "differs", False: "equal"}[m.input_differs]
                cnt = f"{m.differing}/{m.tokens} ({m.fraction:.1%})"
                lines.append(f"{m.order:>4}  {m.name:<{nw}}  {m.type:<{tw}}  {inp:<7}  {cnt:>20}  "
                             f"{m.max_abs_diff:>11.3e}{mark}")
            if len(shown) < len(rows):
                lines.append(f"      ... {len(rows) - len(shown)} more (table(max_rows=None) shows all)")
        for name, why in self.skipped:
            lines.append(f"skipped {name}: {why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


WAYS = ("alone", "batch_right_padded", "batch_left_padded")
_WAY_ALIASES = {"batch": "batch_right_padded"}


def _hf_forward(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> Any:
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)


def _preset_way(model: torch.nn.Module, name: str, seqs: list[torch.Tensor], pad_id: int,
                forward: Callable[..., Any]) -> Way:
    """``seqs`` (1-D id tensors) one at a time or in one padded batch; token (s, t) has identity offset[s] + t."""
    offsets = [sum(len(s) for s in seqs[:i]) for i in range(len(seqs))]
    device = seqs[0].device

    def call(ids: torch.Tensor, mask: torch.Tensor) -> Callable[[], Any]:
        # Positions count real tokens only, so a left-padded sequence starts at 0 as it does alone.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return lambda: forward(model, ids, mask, pos)

    if name == "alone":
        runs = [(call(s[None], torch.ones(1, len(s), dtype=torch.long, device=device)),
                 torch.arange(o, o + len(s))[None]) for s, o in zip(seqs, offsets)]
        return Way(name, runs)
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=seqs[0].dtype, device=device)
    mask = torch.zeros(len(seqs), L, dtype=torch.long, device=device)
    tmap = torch.full((len(seqs), L), -1, dtype=torch.long)
    for i, (s, o) in enumerate(zip(seqs, offsets)):
        at = slice(L - len(s), L) if name == "batch_left_padded" else slice(0, len(s))
        ids[i, at], mask[i, at], tmap[i, at] = s, 1, torch.arange(o, o + len(s))
    return Way(name, [(call(ids, mask), tmap)])


def _as_way(model: torch.nn.Module, which: str, way: Any, seqs: list[torch.Tensor] | None, pad_id: int,
            forward: Callable[..., Any]) -> Way:
    if isinstance(way, str):
        name = _WAY_ALIASES.get(way, way)
        if name not in WAYS:
            raise ValueError(f"{_LOCATE}: unknown {which} {way!r}; expected one of "
                             f"{', '.join(WAYS + tuple(_WAY_ALIASES))}, or a Way / (run, token_map) pair")
        if seqs is None:
            raise ValueError(f"{_LOCATE}: {which}={way!r} needs input_ids (a list of 1-D token-id tensors)")
        return _preset_way(model, name, seqs, pad_id, forward)
    if isinstance(way, tuple) and len(way) == 2 and callable(way[0]):
        way = Way(which, [way])
    if not isinstance(way, Way):
        raise TypeError(f"{_LOCATE}: {which} must be one of {', '.join(WAYS)}, a Way or a (run, token_map) "
                        f"pair, got {type(way).__name__}")
    label = which if way.name == which else f"{which} {way.name!r}"
    if not way.runs:
        raise ValueError(f"{_LOCATE}: {label} has no runs")
    seen: set[int] = set()
    for i, run in enumerate(way.runs):
        if not (isinstance(run, tuple) and len(run) == 2 and callable(run[0])):
            raise TypeError(f"{_LOCATE}: {label} run {i} must be a (callable, token_map) pair")
        tmap = run[1]
        if not isinstance(tmap, torch.Tensor) or tmap.dim() != 2 or tmap.is_floating_point() or tmap.is_complex() \
                or tmap.dtype == torch.bool:
            got = f"{tmap.dtype} tensor of shape {tuple(tmap.shape)}" if isinstance(tmap, torch.Tensor) \
                else type(tmap).__name__
            raise TypeError(f"{_LOCATE}: {label} run {i}: token_map must be an integer [B, L] "
                            f"tensor, got {got}")
        ids = tmap[tmap >= 0].tolist()
        if bool((tmap < -1).any()):
            raise ValueError(f"{_LOCATE}: {label} run {i}: token_map entries must be >= 0 "
                             f"(a token) or -1 (not compared), got {int(tmap.min())}")
        dup = seen.intersection(ids)
        if not dup and len(set(ids)) != len(ids):
            dup = {t for t in ids if t in seen or seen.add(t)}  # type: ignore[func-returns-value]
        if dup:
            raise ValueError(f"{_LOCATE}: {label} maps token {min(dup)} to more than one "
                             f"position (run {i})")
        seen.update(ids)
    return way


def _check_sequences(input_ids: Any) -> list[torch.Tensor] | None:
    if input_ids is None:
        return None
    if isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{_LOCATE}: input_ids must be a list of 1-D token-id tensors (sequences of any "
                        f"lengths), got a tensor of shape {tuple(input_ids.shape)}; use list(ids) for the rows "
                        "of an unpadded [B, L] batch")
    seqs = list(input_ids)
    if not seqs:
        raise ValueError(f"{_LOCATE}: input_ids is empty: no tokens to compare")
    for i, s in enumerate(seqs):
        if not isinstance(s, torch.Tensor) or s.dim() != 1 or s.is_floating_point() or s.dtype == torch.bool:
            got = f"{s.dtype} tensor of shape {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise TypeError(f"{_LOCATE}: input_ids[{i}] must be a 1-D integer tensor, got {got}")
        if len(s) == 0:
            raise ValueError(f"{_LOCATE}: input_ids[{i}] is empty")
        if s.device != seqs[0].device:
            raise ValueError(f"{_LOCATE}: input_ids[{i}] is on {s.device}, input_ids[0] on {seqs[0].device}")
    return seqs


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):  # transformers' ModelOutput: logits / last_hidden_state first
        out = out.to_tuple()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class _Recorder:
    """Forward hooks on every module; keeps each per-token output's rows by token identity."""

    def __init__(self, named: list[tuple[str, torch.nn.Module]]) -> None:
        self.named = named
        self.order: list[tuple[str, int]] = []          # keys in the order their forward returned
        self.types: dict[tuple[str, int], str] = {}
        self.rows: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.inputs: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]] | None] = {}
        self.skipped: dict[tuple[str, int], str] = {}
        self.tmap: torch.Tensor | None = None
        self.calls: dict[str, int] = {}

    def hook(self, name: str) -> Callable[..., None]:
        def record(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> None:
            k = self.calls.get(name, 0) + 1
            self.calls[name] = k
            key = (name, k)
            if key not in self.types:
                self.order.append(key)
                self.types[key] = type(module).__name__
            if key in self.skipped:
                return
            t = _first_tensor(out)
            B, L = self.tmap.shape
            if t is None:
                self.skipped[key] = f"output is {type(out).__name__}, not a tensor or a tuple starting with one"
            elif t.dim() < 2 or tuple(t.shape[:2]) != (B, L):
                self.skipped[key] = (f"output shape {tuple(t.shape)} is not per-token (does not start with the "
                                     f"run's [B, L] = [{B}, {L}])")
            else:
                sel = self.tmap >= 0
                ids = self.tmap[sel]
                b, l = sel.nonzero(as_tuple=True)
                # Advanced indexing copies, so later in-place updates of the output cannot reach the record.
                self.rows.setdefault(key, []).append((ids, t.detach()[b.to(t.device), l.to(t.device)]))
                x = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
                if x is None or x.dim() < 2 or tuple(x.shape[:2]) != (B, L):
                    self.inputs[key] = None
                elif self.inputs.get(key, []) is not None:
                    self.inputs.setdefault(key, []).append((ids, x.detach()[b.to(x.device), l.to(x.device)]))
        return record

    def run(self, way: Way) -> None:
        handles = [m.register_forward_hook(self.hook(n), with_kwargs=True) for n, m in self.named]
        try:
            with torch.no_grad():
                for fn, tmap in way.runs:
                    self.tmap, self.calls = tmap.cpu().long(), {}
                    fn()
        finally:
            for h in handles:
                h.remove()

    def table(self, key: tuple[str, int], inputs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted token ids, their output (or first input) rows [n, ...]) of ``key`` over all runs."""
        parts = (self.inputs if inputs else self.rows)[key]
        ids = torch.cat([p[0] for p in parts])
        if any(p[1].shape[1:] != parts[0][1].shape[1:] or p[1].dtype != parts[0][1].dtype for p in parts):
            raise _Skip("per-token output shape or dtype differs between runs")
        rows = torch.cat([p[1].to(parts[0][1].device) for p in parts])
        order = ids.argsort()
        return ids[order], rows[order.to(rows.device)]


class _Skip(Exception):
    pass


def _drift(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """(tokens whose bits differ, max |a - b| in float64 over them; inf where one side is NaN)."""
    def per_token(t: torch.Tensor) -> torch.Tensor:
        return t.flatten(1) if t.dim() > 1 else t[:, None]

    ba, bb = per_token(_bits(a)), per_token(_bits(b.to(a.device)))
    bad = (ba != bb).any(dim=1)
    n = int(bad.sum())
    if not n:
        return 0, 0.0
    x, y = a[bad], b.to(a.device)[bad]
    if x.is_complex():
        x, y = torch.view_as_real(x.resolve_conj()), torch.view_as_real(y.resolve_conj())
    x, y = x.double(), y.double()
    d = (x - y).abs()
    both_nan = torch.isnan(x) & torch.isnan(y)
    d = torch.where(both_nan, torch.zeros_like(d), d).nan_to_num(nan=float("inf"))
    return n, float(d.max()) if d.numel() else 0.0


def _input_differs(recs: list[_Recorder], key: tuple[str, int]) -> bool | None:
    if not all(r.inputs.get(key) for r in recs):
        return None
    try:
        (ia, xa), (ib, xb) = recs[0].table(key, inputs=True), recs[1].table(key, inputs=True)
    except _Skip:
        return None
    if not torch.equal(ia, ib) or xa.shape != xb.shape or xa.dtype != xb.dtype:
        return None
    return _drift(xa, xb)[0] > 0


def locate_divergence(model: torch.nn.Module, input_ids: Sequence[torch.Tensor] | None = None,
                      way_a: str | Way | tuple = "alone", way_b: str | Way | tuple = "batch_right_padded", *,
                      pad_id: int = 0, forward: Callable[..., Any] | None = None,
                      include: Callable[[str, torch.nn.Module], bool] | None = None) -> DivergenceReport:
    """Run the same tokens two ways and find the first module whose output for a token changes bits.

    Every submodule of ``model`` (and ``model`` itself) gets a forward hook; a module
    output that is a tensor [B, L, ...] (or a tuple / ``ModelOutput`` whose first
    tensor is) is kept row by row per token; other outputs are skipped and listed with
    the reason. Each module output is then compared token by token between the ways,
    bitwise (NaN-safe; -0.0 differs from 0.0), with max |delta| in float64. Execution
    order is the order in which forwards return, so the first divergent module is the
    innermost op where the bits first change. Runs under ``torch.no_grad()`` in the
    current mode: wrap the call in ``rlkernels.set_batch_invariant_mode()`` to locate
    drift in a patched model.

    ``input_ids``: sequences as 1-D integer tensors (any lengths >= 1, on the model's
    device), for the named ways: ``"alone"`` (each sequence as a batch of one),
    ``"batch_right_padded"`` (alias ``"batch"``) and ``"batch_left_padded"`` (all in
    one batch, padded with ``pad_id``, attention mask 0 there, positions counting real
    tokens). The named ways call ``forward(model, input_ids, attention_mask,
    position_ids)``, by default ``model(input_ids=..., attention_mask=...,
    position_ids=..., use_cache=False)`` (a Hugging Face causal LM).
    Any other way is a :class:`Way`, or a ``(run, token_map)`` pair for one forward
    pass: ``run()`` runs the model, ``token_map`` [B, L] gives each output position's
    token identity (-1: skip); both ways must cover the same identities.
    ``include(name, module)``: hook only the modules it accepts (default: all).

    Returns a :class:`DivergenceReport` (``.first``, ``.divergent``, ``.table()``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_LOCATE}: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise TypeError(f"{_LOCATE}: pad_id must be an integer token id, got {pad_id!r}")
    if forward is not None and not callable(forward):
        raise TypeError(f"{_LOCATE}: forward must be callable, got {type(forward).__name__}")
    seqs = _check_sequences(input_ids)
    fwd = forward or _hf_forward
    ways = [_as_way(model, "way_a", way_a, seqs, pad_id, fwd), _as_way(model, "way_b", way_b, seqs, pad_id, fwd)]
    covered = [{int(t) for _, m in w.runs for t in m[m >= 0].tolist()} for w in ways]
    if covered[0] != covered[1]:
        only = sorted(covered[0] ^ covered[1])
        raise ValueError(f"{_LOCATE}: the ways cover different tokens ({len(covered[0])} in {ways[0].name!r}, "
                         f"{len(covered[1])} in {ways[1].name!r}; e.g. token {only[0]} is in only one)")
    if not covered[0]:
        raise ValueError(f"{_LOCATE}: the token maps mark no token (all -1): nothing to compare")
    if model.training:
        warnings.warn(f"{_LOCATE}: model is in training mode; dropout makes outputs differ by chance "
                      "(call model.eval())", stacklevel=2)
    named = [(n or "(model)", m) for n, m in model.named_modules() if include is None or include(n or "(model)", m)]
    if not named:
        raise ValueError(f"{_LOCATE}: include accepted no module of the model: nothing to hook")
    recs = [_Recorder(named), _Recorder(named)]
    for rec, way in zip(recs, ways):
        rec.run(way)
    modules: list[ModuleDrift] = []
    skipped: list[tuple[str, str]] = []
    order = recs[0].order + [k for k in recs[1].order if k not in recs[0].types]
    for key in order:
        label = key[0] if key[1] == 1 else f"{key[0]}#{key[1]}"
        why = next((r.skipped[key] for r in recs if key in r.skipped), None)
        if why is None and not all(key in r.rows for r in recs):
            missing = ways[0].name if key not in recs[0].rows else ways[1].name
            why = f"not called in {missing!r}"
        if why is None:
            try:
                (ia, ra), (ib, rb) = recs[0].table(key), recs[1].table(key)
                if not torch.equal(ia, ib):
                    raise _Skip("called for different tokens in the two ways")
                if ra.shape != rb.shape or ra.dtype != rb.dtype:
                    raise _Skip(f"per-token output {ra.dtype} {tuple(ra.shape[1:])} in {ways[0].name!r}, "
                                f"{rb.dtype} {tuple(rb.shape[1:])} in {ways[1].name!r}")
            except _Skip as e:
                why = str(e)
        if why is not None:
            skipped.append((label, why))
            continue
        n, worst = _drift(ra, rb)
        modules.append(ModuleDrift(label, recs[0].types.get(key) or recs[1].types[key], len(modules) + 1,
                                   len(ia), n, worst, _input_differs(recs, key)))
    if not modules:
        raise ValueError(f"{_LOCATE}: no hooked module returned a per-token [B, L, ...] output; skipped: "
                         + "; ".join(f"{n}: {w}" for n, w in skipped[:5]))
    return DivergenceReport(ways[0].name, ways[1].name, len(covered[0]), modules, skipped)
