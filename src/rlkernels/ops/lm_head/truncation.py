"""Top-k and top-p truncation of the LM head's distribution: each row's threshold tau.

The order is Hugging Face's and vLLM's: temperature, then top-k, then top-p over the
top-k-renormalised distribution. Over the scaled logits z of a row:

* top-k keeps ``{v : z_v >= z_(k)}``, z_(k) the k-th largest (ties at it kept);
* top-p keeps the smallest set of the largest probabilities of that distribution whose
  mass reaches p, and every logit equal to the smallest kept one (ties at the border);
* the kept set is ``{v : z_v >= tau}``, tau the smallest kept logit: one fp32 per row,
  which the sampler returns and the trainer hands back (``logit_threshold``). -inf keeps
  every logit.

Each row's tau is a function of that row's logits alone. The k-th largest value comes
from ``torch.topk``'s values (which do not depend on how it finds them). The top-p masses
are ``exp(z - max)`` in fp64 and p is taken of their total over the top-k set, so the
nucleus is resolved to fp64 precision even for p near 1; they are summed over the row's
largest values in descending order (the nucleus's candidates, :data:`TOP_P_CANDIDATES`
of them), and where those do not reach p the threshold is searched over the whole row.
The Triton backend reads the raw logits, scores them in registers and finds the candidates
chunk by chunk (``kernels.truncation``: no sort of the row, three launches); the torch
backend by ``torch.topk`` over the scores, and it sums by a prefix scan of elementwise adds
and pairwise trees, whose orders are fixed by the counts.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from ..._env import triton_interpret
from ...kernels._triton import cdiv, pow2_at_least
from ...kernels.truncation import chunk_stats_kernel, chunk_top_kernel, row_filter_kernel, threshold_kernel
from ...runtime.launcher import DEFAULT_NUM_STAGES, cached_launcher
from .config import NO_TRANSFORM, LogitTransform, to_fp32
from .lse import LSE_TILE, tree_rowsum
from .statistics import TritonHeadStatistics

# How many of a row's largest logits the nucleus is first looked for in (a power of two):
# the torch backend's candidates, and each Triton chunk's (the kernels look in the row's
# FIRST_TIER largest, then in all the chunks' candidates); rows whose nucleus is wider are
# searched in full. The threshold does not depend on it (beyond fp64 rounding: the Triton
# backend's chunk masses, and its sums over the first tier or over all the candidates).
TOP_P_CANDIDATES = 64
# The Triton backend's smallest chunk of a row (a power of two): each yields its
# TOP_P_CANDIDATES largest, and the row's mass is merged from the chunks', so its fp64
# rounding is a function of V and these constants.
CANDIDATE_CHUNK = 4096
# The most candidates one program sorts (the chunks grow past CANDIDATE_CHUNK to fit), and
# the whole-row search's block.
FINAL_CANDIDATES = 4096
SEARCH_BLOCK = 1024
# How many of a row's largest candidates the top-p row program looks for the nucleus in
# first (a power of two, at least TOP_P_CANDIDATES); a wider nucleus is searched over all
# the candidates by bisection.
FIRST_TIER = 256
# Top-p alone's row filter: a histogram of each chunk's scores on a grid of this width (in
# units of z), this many bins down from the chunk's max (the last holds every lower logit).
# The filter is the highest edge below which the bins bound the mass under (1 - p) of the
# row's, so it lies within a bin or two of the nucleus's border.
FILTER_BIN_WIDTH = 0.5
FILTER_BINS = 32
# Rows per program of the Triton kernels (they take a block of rows; one keeps every SM busy
# at decode sizes).
ROWS_PER_PROGRAM = 1

_launch_chunk_stats = cached_launcher(chunk_stats_kernel) if chunk_stats_kernel is not None else None
_launch_row_filter = cached_launcher(row_filter_kernel) if row_filter_kernel is not None else None
_launch_chunk_top = cached_launcher(chunk_top_kernel) if chunk_top_kernel is not None else None
_launch_threshold = cached_launcher(threshold_kernel) if threshold_kernel is not None else None


def validate_truncation(op: str, top_k: object, top_p: object) -> None:
    """``top_k`` an int >= 0 (0: off), ``top_p`` a real number in (0, 1] (1: off); raises
    TypeError/ValueError naming ``op``."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"rlkernels.{op}: top_k must be an int (0 keeps every token), got {top_k!r}")
    if top_k < 0:
        raise ValueError(f"rlkernels.{op}: top_k must be >= 0 (0 keeps every token), got {top_k}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"rlkernels.{op}: top_p must be a number in (0, 1] (1 keeps every token), got {top_p!r}")
    if math.isnan(float(top_p)) or not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"rlkernels.{op}: top_p must lie in (0, 1] (1 keeps every token), got {top_p}")


def truncates(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether (top_k, top_p) can leave out any of ``vocab`` logits."""
    return 0 < top_k < vocab or float(top_p) < 1.0


def split_p(top_p: float) -> tuple[float, float]:
    """p as two fp32 values whose fp64 sum holds its leading 48 bits: the kernels' p (a
    Triton float argument is fp32), and the torch backend's the same way."""
    hi = to_fp32(float(top_p))
    return hi, to_fp32(float(top_p) - hi)


def top_k_floor(z: torch.Tensor, top_k: int) -> torch.Tensor:
    """The k-th largest of each row of ``z`` [N, V] (-inf where top-k keeps every logit)."""
    N, V = z.shape
    if not 0 < top_k < V:
        return torch.full((N,), -math.inf, dtype=z.dtype, device=z.device)
    return torch.topk(z, top_k, dim=1).values[:, -1].contiguous()


def candidates(z: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(each row's largest logits [N, C] descending, the top-k threshold [N], whether the
    candidates hold the whole top-k set but for ties at its threshold), by one ``topk``:
    the top-k set itself where top-k truncates, else TOP_P_CANDIDATES (or V) values."""
    N, V = z.shape
    k = top_k if 0 < top_k < V else 0
    count = k or min(V, TOP_P_CANDIDATES)
    vals = torch.topk(z, count, dim=1).values.contiguous()
    floor = vals[:, k - 1].contiguous() if k else torch.full((N,), -math.inf, dtype=z.dtype, device=z.device)
    return vals, floor, bool(k) or count == V


def threshold(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Each row's kept-set threshold tau [N] from its scores ``z`` [N, V] (fp32 or fp64), on
    the torch backend: the k-th largest, then the nucleus of the distribution top-k leaves."""
    if float(top_p) >= 1.0:
        return top_k_floor(z, top_k)
    vals, floor, covers = candidates(z, top_k)
    if not z.shape[0]:
        return floor
    return _torch_top_p(z, vals, floor, covers, top_p)


def _torch_top_p(z: torch.Tensor, vals: torch.Tensor, floor: torch.Tensor, covers: bool,
                 top_p: float) -> torch.Tensor:
    """The top-p threshold (at least ``floor``) on the torch backend, elementwise ops only:
    ``kernels.truncation``'s definition."""
    hi, lo = split_p(top_p)
    top = vals[:, :1].to(torch.float64)
    keys, floor_key = _order_key(z), _order_key(floor)
    e_row = torch.exp(z.to(torch.float64) - top)
    target = (torch.tensor(hi, dtype=torch.float64) + lo).item() * _mass_above(keys, e_row, floor_key)
    cum = torch.exp(vals.to(torch.float64) - top)
    step = 1
    while step < cum.shape[1]:  # inclusive prefix sums: Hillis-Steele, an order fixed by the count
        cum = torch.cat([cum[:, :step], cum[:, step:] + cum[:, :-step]], dim=1)
        step *= 2
    hit = cum >= target[:, None]
    found = hit.any(dim=1)
    tau = vals.gather(1, hit.int().argmax(dim=1)[:, None])[:, 0]
    if covers:
        return torch.maximum(torch.where(found, tau, floor), floor)
    rest = (~found).nonzero()[:, 0]
    if rest.numel():
        tau[rest] = _torch_search(z[rest], keys[rest], e_row[rest], floor_key[rest], target[rest])
    return torch.maximum(tau, floor)


def _order_key(z: torch.Tensor) -> torch.Tensor:
    """``kernels.truncation.order_key`` (of z rounded to fp32), in int64."""
    bits = z.to(torch.float32).view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _mass_above(keys: torch.Tensor, e: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Each row's mass ``e`` [R, V] over the logits whose key is >= t [R] (a pairwise tree)."""
    return tree_rowsum(torch.where(keys >= t[:, None], e, torch.zeros_like(e)))


def _torch_search(z: torch.Tensor, keys: torch.Tensor, e: torch.Tensor, lo: torch.Tensor,
                  target: torch.Tensor) -> torch.Tensor:
    """The whole-row bisection of ``kernels.truncation`` for rows whose candidates fall short."""
    hi = torch.full_like(lo, 1 << 31)
    while bool((hi - lo > 1).any()):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        reach = _mass_above(keys, e, mid) >= target
        lo, hi = torch.where(reach, mid, lo), torch.where(reach, hi, mid)
    return torch.where(keys >= lo[:, None], z, torch.full_like(z, math.inf)).amin(dim=1)


def threshold_of_logits(raw: torch.Tensor, temperature: float, transform: LogitTransform, top_k: int,
                        top_p: float, tile_max: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`threshold` of the scores ``transform(raw) / temperature`` on the Triton backend,
    from the raw fp32 logits ``raw`` [N, V] (the GEMM's), which it scores in registers.

    ``tile_max`` [N, ceil(V / LSE_TILE)] fp32, where given, is filled with each LSE tile's
    largest score, NaN where the tile holds a NaN (:func:`tile_maxima`), in the same read:
    the statistics pass then skips a row's tiles wholly below its threshold."""
    if triton_interpret():
        # The interpreter runs the kernels' sorting networks element by element in numpy,
        # about a second per row: it takes the torch definition, whose thresholds are the
        # kernels', over the scores kernel's z.
        z = TritonHeadStatistics.scores(raw, temperature, transform)
        if tile_max is not None:
            tile_max.copy_(tile_maxima(z))
        return threshold(z, top_k, top_p)
    return _triton_threshold(raw, top_k, top_p, temperature, transform, tile_max)


def tile_maxima(z: torch.Tensor) -> torch.Tensor:
    """Each LSE tile's largest score of ``z`` [N, V]: [N, ceil(V / LSE_TILE)] fp32, NaN where
    the tile holds a NaN (what ``kernels.truncation.chunk_stats_kernel`` writes)."""
    N, V = z.shape
    n_tiles = cdiv(V, LSE_TILE)
    padded = torch.full((N, n_tiles * LSE_TILE), -math.inf, dtype=torch.float32, device=z.device)
    padded[:, :V] = z
    return padded.view(N, n_tiles, LSE_TILE).amax(dim=2)  # amax propagates NaN


# ``kernels.truncation``'s row filters: none, top-p alone's from the chunks' histograms,
# top-k's from the chunks' two largest each, the given top-k threshold.
_NO_FILTER, _TOP_P_HISTOGRAM, _KTH_OF_CHUNKS, _GIVEN_FLOOR = range(4)
# Top-p alone filters where 1 - p is at least this: its filter's margin (a share of the
# excluded mass) then dwarfs the fp64 rounding of the row's prefix masses.
_TAIL_FILTER_MIN = 1e-6
# The top-p filter bounds the excluded mass by (1 - p)(1 - this): room for the fp32
# rounding of the histogram's bound.
_FILTER_SLACK = 1e-3


def _row_filter(k: int, floor_given: bool, top_p: float, n_chunks: int, count: int) -> tuple[int, int]:
    """(the chunk pass's filter, the width its top-k of the chunks' two largest takes)."""
    kth_width = min(count, 2 * pow2_at_least(n_chunks))
    if floor_given:
        return _GIVEN_FLOOR, kth_width
    if k:
        return (_KTH_OF_CHUNKS if k <= min(kth_width, 2 * n_chunks) else _NO_FILTER), kth_width
    if 1.0 - top_p >= _TAIL_FILTER_MIN:
        return _TOP_P_HISTOGRAM, kth_width
    return _NO_FILTER, kth_width


class _ChunkCandidates(NamedTuple):
    """The chunk pass's output over raw logits [N, V]: ``top`` [N, n_chunks * count] the
    candidates (-inf past each chunk's), ``bounds`` [N, n_chunks] (every logit of a chunk
    above its bound is a candidate), ``cmax`` [N, 2 * n_chunks] the chunks' maxima (then
    second largest, where the filter reads them), ``mass`` [N, n_chunks] fp64 their masses
    (with top-p), ``row_filter`` [N] each row's filter (no logit below it kept; -inf: none)."""

    top: torch.Tensor
    bounds: torch.Tensor
    cmax: torch.Tensor
    mass: torch.Tensor
    row_filter: torch.Tensor
    count: int


def _chunk_layout(vocab: int) -> tuple[int, int, int]:
    """(candidates per chunk, chunk width, chunks): few enough chunks that their candidates
    fit one sorted tile; a function of V alone."""
    count = min(TOP_P_CANDIDATES, pow2_at_least(vocab))
    chunk = max(CANDIDATE_CHUNK, count, pow2_at_least(cdiv(vocab * count, FINAL_CANDIDATES)))
    chunk = min(chunk, max(count, pow2_at_least(vocab)))
    return count, chunk, cdiv(vocab, chunk)


def _chunk_candidates(raw: torch.Tensor, k: int, top_p: float, floor: torch.Tensor | None, temperature: float,
                      transform: LogitTransform, tile_max: torch.Tensor | None = None) -> _ChunkCandidates:
    """Each chunk's candidates of the raw fp32 logits [N, V] (``kernels.truncation``'s chunk
    passes) for top-k ``k`` (0: none; ``floor`` [N]: its threshold, given where k exceeds
    the candidates) and top-p; ``tile_max`` filled by the first pass (:func:`tile_maxima`),
    where given and the chunk is a whole number of tiles (else with NaN: no tile skipped)."""
    N, V = raw.shape
    count, chunk, n_chunks = _chunk_layout(V)
    nucleus = top_p < 1.0
    row_filter, kth_width = _row_filter(k, floor is not None, top_p, n_chunks, count)
    bins = FILTER_BINS if row_filter == _TOP_P_HISTOGRAM else 0
    top = torch.empty(N, n_chunks * count, dtype=torch.float32, device=raw.device)
    bounds = torch.empty(N, n_chunks, dtype=torch.float32, device=raw.device)
    cmax = torch.empty(N, 2 * n_chunks, dtype=torch.float32, device=raw.device)
    mass = torch.empty(N, n_chunks, dtype=torch.float64, device=raw.device)
    hist = torch.empty(N, n_chunks, max(bins, 1), dtype=torch.int32, device=raw.device)
    score_args, score_modes = transform.launch_args(temperature, raw.device)
    bin_scale = 1.0 / FILTER_BIN_WIDTH
    tiles = tile_max is not None and chunk % LSE_TILE == 0
    if tile_max is not None and not tiles:
        tile_max.fill_(math.nan)
    _launch_chunk_stats((cdiv(N, ROWS_PER_PROGRAM), n_chunks),
                        (raw, cmax, mass, hist, tile_max if tiles else cmax, N, V, raw.stride(0), n_chunks,
                         cdiv(V, LSE_TILE), bin_scale, *score_args),
                        dict(**score_modes, CHUNK=chunk, BLOCK_R=ROWS_PER_PROGRAM, SECOND=row_filter == _KTH_OF_CHUNKS,
                             MASS=nucleus, BINS=bins, TILE=LSE_TILE if tiles else 0),
                        num_warps=4, num_stages=DEFAULT_NUM_STAGES)
    row_f = floor if floor is not None else torch.full((N,), -math.inf, dtype=torch.float32, device=raw.device)
    if row_filter in (_TOP_P_HISTOGRAM, _KTH_OF_CHUNKS):
        row_f = torch.empty(N, dtype=torch.float32, device=raw.device)
        tail = to_fp32((1.0 - top_p) * (1.0 - _FILTER_SLACK))
        log_tail = to_fp32(math.log((1.0 - top_p) / V) - 1.0) if row_filter == _TOP_P_HISTOGRAM else 0.0
        _launch_row_filter((N,), (cmax, mass, hist, row_f, n_chunks, k, bin_scale, tail, log_tail),
                           dict(FILTER=1 if row_filter == _TOP_P_HISTOGRAM else 2, CHUNKS=pow2_at_least(n_chunks),
                                KB=kth_width, BINS=max(bins, 1)), num_warps=4, num_stages=DEFAULT_NUM_STAGES)
    filtered = row_filter != _NO_FILTER
    _launch_chunk_top((cdiv(N, ROWS_PER_PROGRAM), n_chunks),
                      (raw, cmax, row_f, tile_max if tiles else cmax, top, bounds, N, V, raw.stride(0), n_chunks,
                       cdiv(V, LSE_TILE), *score_args),
                      dict(**score_modes, CHUNK=chunk, C=count, BLOCK_R=ROWS_PER_PROGRAM, FILTERED=filtered,
                           TILE=LSE_TILE if tiles and filtered else 0), num_warps=4, num_stages=DEFAULT_NUM_STAGES)
    return _ChunkCandidates(top, bounds, cmax, mass, row_f, count)


def _first_tier(count: int, n_chunks: int, nucleus: bool, k: int = 0) -> int:
    """The row program's first tier: FIRST_TIER of the candidates for top-p (within their
    tile); ``count`` where a top-k of at most ``count`` bounds the nucleus too, or alone
    (its threshold is the k-th of them)."""
    if not nucleus or 0 < k <= count:
        return count
    return max(count, min(FIRST_TIER, pow2_at_least(n_chunks * count)))


def _triton_threshold(raw: torch.Tensor, top_k: int, top_p: float, temperature: float = 1.0,
                      transform: LogitTransform = NO_TRANSFORM, tile_max: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_torch_top_p`'s threshold (or top-k's) by ``kernels.truncation`` from the raw
    fp32 logits: each chunk's candidates, then the threshold from the row's largest of them
    (all of them sorted, or the whole row, where the nucleus is wider). ``tile_max``: as
    :func:`threshold_of_logits` fills it (NaN throughout where the chunk pass does not run)."""
    N, V = raw.shape
    k = top_k if 0 < top_k < V else 0
    nucleus = float(top_p) < 1.0
    out = torch.full((N,), -math.inf, dtype=torch.float32, device=raw.device)
    count, _, n_chunks = _chunk_layout(V)
    floor_given = k > count
    chunk_pass = N and (nucleus or 0 < k <= count)
    if tile_max is not None and not chunk_pass:
        tile_max.fill_(math.nan)  # no tile is known to lie below the threshold
    if not N or not (k or nucleus):
        return out
    # A k beyond the candidates: its k-th largest by torch.topk over the scores, written out.
    floor = top_k_floor(TritonHeadStatistics.scores(raw, temperature, transform), k) if floor_given else out
    if not chunk_pass:
        return floor
    cand = _chunk_candidates(raw, k, float(top_p), floor if floor_given else None, temperature, transform, tile_max)
    score_args, score_modes = transform.launch_args(temperature, raw.device)
    hi, lo = split_p(top_p)
    k_in_candidates = 0 if floor_given else k
    _launch_threshold((cdiv(N, ROWS_PER_PROGRAM),),
                      (cand.top, cand.bounds, cand.cmax, cand.mass, raw, floor, out, N, n_chunks, V, raw.stride(0),
                       k_in_candidates, hi, lo, *score_args),
                      dict(**score_modes, FINAL=pow2_at_least(n_chunks * count), CHUNKS=pow2_at_least(n_chunks),
                           C=count, FIRST=_first_tier(count, n_chunks, nucleus, k_in_candidates),
                           BLOCK_R=ROWS_PER_PROGRAM, TOP_P=nucleus, FLOOR_GIVEN=floor_given, BLOCK=SEARCH_BLOCK),
                      num_warps=8, num_stages=DEFAULT_NUM_STAGES)
    return out
