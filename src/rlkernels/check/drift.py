"""The drift locator: which module first changes a token's bits between two ways of running a model.

:func:`locate_divergence` hooks every module, runs the same tokens two ways (one
sequence at a time, a padded batch, or any caller-built :class:`Way`) and compares
each module's per-token output bitwise; ``rlkernels check --locate``
(:mod:`rlkernels.check.locate`) runs it on the check's model. See
docs/operators/drift_locator.md.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..testing import _bits

__all__ = ["locate_divergence", "Way", "ModuleDrift", "DivergenceReport"]


_LOCATE = "rlkernels.check.locate_divergence"


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
