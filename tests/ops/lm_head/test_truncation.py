"""Top-k / top-p thresholds: the kept set against a float64 sort-based reference.

The torch backend, and the Triton kernels under TRITON_INTERPRET=1 against it, through the
nucleus's candidates and through the whole-row search (a small candidate count forces it).
Logits at a trained model's scale (std ~6).
"""
from __future__ import annotations

import math

import pytest
import torch

from rlkernels._env import triton_interpret
from rlkernels.ops.lm_head import truncation as TR
from rlkernels.ops.lm_head.config import LogitTransform
from rlkernels.ops.lm_head.statistics import TritonHeadStatistics
from rlkernels.ops.lm_head.truncation import split_p, threshold, top_k_floor, truncates, validate_truncation

from ...conftest import randn

kernels_only = pytest.mark.skipif(not triton_interpret(), reason="the Triton kernels run under TRITON_INTERPRET=1")
TRUNCATIONS = [(5, 1.0), (0, 0.9), (0, 0.5), (40, 0.8), (3, 0.999), (0, 0.999999), (0, 1e-6), (1, 0.9)]


def reference_threshold(z: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(tau [N], margin [N]) by sorting in float64: the k-th largest, then the first sorted
    value whose prefix mass reaches p of the top-k mass. ``margin`` is how far the prefix
    masses on either side of the border lie from p * total (relative): where it is below
    fp64 rounding the border is a coin toss for any summation order."""
    z64 = z.double()
    N, V = z.shape
    taus, margins = [], []
    for r in range(N):
        vals = torch.sort(z64[r], descending=True).values
        floor = vals[top_k - 1] if 0 < top_k < V else -math.inf
        kept = vals[vals >= floor]
        if top_p >= 1.0:
            taus.append(floor)
            margins.append(math.inf)
            continue
        e = torch.exp(kept - kept[0])
        cum = torch.cumsum(e, 0)
        target = split_p(top_p)[0] + split_p(top_p)[1]
        target = target * float(e.sum())
        i = int((cum >= target).nonzero()[0, 0]) if bool((cum >= target).any()) else len(kept) - 1
        taus.append(float(kept[i]))
        below = float(cum[i - 1]) if i > 0 else 0.0
        margins.append(min(abs(float(cum[i]) - target), abs(target - below)) / float(e.sum()))
    return torch.tensor(taus, dtype=torch.float64), torch.tensor(margins, dtype=torch.float64)


def _scaled_logits(n, v, gen, std=6.0):
    return randn(n, v, generator=gen, scale=std)


def _small_chunks(monkeypatch, candidates):
    """The kernels' chunking at a test's size: chunks of 64 logits, each giving
    ``candidates`` of them (several chunks per row, and rows whose nucleus is wider)."""
    monkeypatch.setattr(TR, "TOP_P_CANDIDATES", candidates)
    monkeypatch.setattr(TR, "CANDIDATE_CHUNK", 64)
    monkeypatch.setattr(TR, "FINAL_CANDIDATES", 64)


@pytest.mark.parametrize("candidates", [1024, 4])
@pytest.mark.parametrize("top_k, top_p", TRUNCATIONS)
def test_the_threshold_is_the_sorted_references(candidates, top_k, top_p, gen, monkeypatch):
    monkeypatch.setattr(TR, "TOP_P_CANDIDATES", candidates)
    z = _scaled_logits(37, 257, gen)
    tau = threshold(z, top_k, top_p)
    want, margin = reference_threshold(z, top_k, top_p)
    clear = margin > 1e-12
    assert clear.sum() >= 30
    assert torch.equal(tau.double()[clear], want[clear])
    kept = z >= tau[:, None]
    assert (kept.sum(dim=1) >= 1).all()  # the largest logit is always kept
    if top_k:
        assert (kept.sum(dim=1) <= top_k).all()  # no ties at these values


@kernels_only
@pytest.mark.parametrize("candidates, first_tier", [(4, 4), (8, 8), (4, 16)])
@pytest.mark.parametrize("temperature, transform", [(1.0, LogitTransform()), (0.7, LogitTransform(0.5, 20.0))],
                         ids=["plain", "scaled-capped"])
def test_the_kernels_threshold_is_the_torch_backends(candidates, first_tier, temperature, transform, gen,
                                                     monkeypatch):
    """Nuclei within the row program's first tier, and wider ones, which it bisects over all
    the candidates (or, past them, over the whole row)."""
    _small_chunks(monkeypatch, candidates)
    monkeypatch.setattr(TR, "FIRST_TIER", first_tier)
    raw = _scaled_logits(6, 300, gen)
    raw[1] *= 0.02  # a flat row: its nucleus is wider than every chunk's candidates
    raw[5, 10], raw[5, 70:73] = 30.0, 27.0  # a peaked row: most chunks lie below its filter
    raw[3, 5:9] = raw[3].max()  # ties at the top, in one chunk
    # Twelve near-equal largest logits, one per chunk and two in the first: a nucleus wider
    # than the row's `candidates` largest, within the chunks' candidates.
    raw[4] = raw[4] * 0.1 - 20.0
    raw[4, [0, 1, 64, 65, 128, 129, 192, 193, 256, 257, 2, 66]] = 10.0 + torch.arange(12) * 0.01
    # The kernels score the raw logits themselves (the model's transform, then / T).
    z = TritonHeadStatistics.scores(raw, temperature, transform)
    for top_k, top_p in TRUNCATIONS:
        got = TR._triton_threshold(raw, top_k, top_p, temperature, transform)
        want, margin = reference_threshold(z, top_k, top_p)
        clear = margin > 1e-12
        assert clear.sum() >= 4
        assert torch.equal(got.double()[clear], want[clear]), (top_k, top_p)
        assert torch.equal(got[clear].view(torch.int32), threshold(z, top_k, top_p)[clear].view(torch.int32))
    # Row 4's nucleus at p = 0.9 holds about eleven logits: past the row's largest few.
    assert (z[4] >= TR._triton_threshold(raw, 0, 0.9, temperature, transform)[4]).sum() > candidates
    assert TR._first_tier(candidates, 5, True) == first_tier


@kernels_only
@pytest.mark.parametrize("top_k, top_p, floor_given, paths_taken", [
    (0, 0.9, False, {"none", "scan", "top-C"}),  # top-p alone: the row's max - ln(V / (1 - p)) - 1
    (3, 0.9, False, {"none", "scan"}),  # top-k: the 3rd largest of the chunks' two largest
    (1, 1.0, False, {"none", "scan"}),
    (40, 0.9, True, {"scan", "top-C"}),  # the given top-k threshold
])
def test_each_chunk_yields_its_largest_logits_and_every_one_above_its_bound(top_k, top_p, floor_given, paths_taken,
                                                                            gen, monkeypatch):
    """The chunk pass: a chunk's candidates are its largest logits, every logit of it above
    its bound among them; chunks wholly below the row's filter yield none, chunks with few
    logits above it yield those, the others their C largest."""
    _small_chunks(monkeypatch, 4)
    raw = _scaled_logits(6, 300, gen)
    raw[1] *= 0.02  # flat: every chunk holds more than C logits above the filter
    raw[2, 10] = 60.0  # one logit far above the rest: the other chunks lie below the filter
    raw[5, 10], raw[5, 70:73] = 30.0, 27.0  # four logits above the filter, in two chunks
    z = TritonHeadStatistics.scores(raw, 1.0, LogitTransform())
    floor = top_k_floor(z, top_k) if floor_given else None
    cand = TR._chunk_candidates(raw, top_k, top_p, floor, 1.0, LogitTransform())
    C, width = cand.count, TR.CANDIDATE_CHUNK
    paths = {"none": 0, "scan": 0, "top-C": 0}
    for r in range(z.shape[0]):
        for c in range(cand.bounds.shape[1]):
            mine = z[r, c * width:(c + 1) * width]
            got = cand.top[r, c * C:(c + 1) * C]
            got = torch.sort(got[got > -math.inf], descending=True).values
            assert torch.equal(got, torch.sort(mine, descending=True).values[:len(got)]), (r, c)
            bound = cand.bounds[r, c]
            assert int((mine > bound).sum()) <= len(got), (r, c)
            if not len(got):
                paths["none"] += 1
            elif len(got) == C and bound == got[-1]:
                paths["top-C"] += 1
            else:
                paths["scan"] += 1
        assert cand.cmax[r, 0] == z[r, :width].max()
    assert {path for path, n in paths.items() if n} == paths_taken, paths


@kernels_only
@pytest.mark.parametrize("top_p", [0.9, 0.5, 0.999])
def test_the_top_p_filter_leaves_the_nucleus_whole_and_little_else(top_p, gen, monkeypatch):
    """Top-p alone's row filter f (the chunks' histograms): the logits below it hold less
    than 1 - p of the mass, so the nucleus lies above it, whatever the row; on rows at a
    trained model's scale it lets through few more logits than the nucleus holds."""
    _small_chunks(monkeypatch, 4)
    temperature = 0.8
    raw = _scaled_logits(12, 300, gen)
    raw[1] *= 0.02  # flat: the nucleus is most of the row
    raw[2, 10] = 60.0  # one logit holds the mass
    raw[3, 5:9] = raw[3].max()  # ties at the top
    raw[4, 100:] = -math.inf  # a masked tail, in the chunks' last bins
    raw[5] = raw[5] * 0.1 - 20.0
    raw[5, [0, 64, 128, 192, 256]] = 10.0  # equal maxima, one per chunk
    raw[6, 250:] = raw[6, 250:] + 12.0  # the mass in the last, partial chunk
    z = TritonHeadStatistics.scores(raw, temperature, LogitTransform())
    f = TR._chunk_candidates(raw, 0, top_p, None, temperature, LogitTransform()).row_filter
    tau, _ = reference_threshold(z, 0, top_p)
    top = z.max(dim=1).values.double()
    mass = torch.exp(z.double() - top[:, None])
    below = torch.where(z < f[:, None], mass, torch.zeros_like(mass)).sum(dim=1) / mass.sum(dim=1)
    assert (below < 1.0 - top_p).all(), below
    assert (f.double() <= tau).all()
    # Never below the bound from the row's max alone.
    assert (f.double() >= top + math.log((1.0 - top_p) / z.shape[1]) - 1.0 - 1e-5).all()
    trained = [0] + list(range(7, 12))
    nucleus = (z >= tau.float()[:, None]).sum(dim=1)[trained]
    passed = (z >= f[:, None]).sum(dim=1)[trained]
    assert (passed <= 3 * nucleus + 4).all(), (passed, nucleus)


@kernels_only
@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (3, 1.0), (40, 0.8)])
def test_the_chunk_pass_records_each_tiles_max_and_nan(top_k, top_p, gen, monkeypatch):
    """The first pass's tile maxima (the statistics pass skips a row's tiles below its
    threshold by them) are ``tile_maxima``'s, NaN where a tile holds one; with chunks
    narrower than a tile it records none, and says so with NaN throughout."""
    monkeypatch.setattr(TR, "CANDIDATE_CHUNK", 2 * TR.LSE_TILE)
    V = 5 * TR.LSE_TILE + 45  # three chunks of two tiles, the last tile partial
    assert TR._chunk_layout(V)[1:] == (2 * TR.LSE_TILE, 3)
    raw = _scaled_logits(3, V, gen)
    raw[1, 7] = math.nan
    raw[2, 4 * TR.LSE_TILE + 30] = math.nan
    z = TritonHeadStatistics.scores(raw, 0.8, LogitTransform())
    tile_max = torch.full((3, math.ceil(V / TR.LSE_TILE)), 12345.0)
    tau = TR._triton_threshold(raw, top_k, top_p, 0.8, LogitTransform(), tile_max)
    want = TR.tile_maxima(z)
    assert torch.isnan(want).sum() == 2 and torch.equal(torch.isnan(tile_max), torch.isnan(want))
    assert torch.equal(tile_max.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))
    # The candidate pass reads only the tiles at or above the row's filter (by the map, NaN
    # ones included): the thresholds are the whole chunks' read's, and the definition's.
    assert torch.equal(tau.view(torch.int32), TR._triton_threshold(raw, top_k, top_p, 0.8).view(torch.int32))
    assert torch.equal(tau[0].view(torch.int32), threshold(z[:1], top_k, top_p)[0].view(torch.int32))
    _small_chunks(monkeypatch, 4)
    short = raw[:, :300].contiguous()  # chunks of 64
    assert TR._chunk_layout(300)[1] < TR.LSE_TILE
    tile_max = torch.zeros(3, 2)
    TR._triton_threshold(short, top_k, top_p, 0.8, LogitTransform(), tile_max)
    assert torch.isnan(tile_max).all()


BACKENDS = ["torch", pytest.param("kernels", marks=kernels_only)]


def _threshold(backend, z, top_k, top_p):
    return threshold(z, top_k, top_p) if backend == "torch" else TR._triton_threshold(z, top_k, top_p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_at_the_border_are_kept(backend, monkeypatch):
    _small_chunks(monkeypatch, 4)
    z = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0, -2.0, -7.0]])
    floor = top_k_floor(z, 2)
    assert floor.tolist() == [3.0]
    assert (z >= floor[:, None]).sum() == 4  # the k-th's ties are kept
    # Masses 0.70, 0.095 each for the 3.0s: p = 0.8 is reached at the second 3.0, and the
    # third, its tie, is kept too; nothing below.
    assert _threshold(backend, z, 0, 0.8).tolist() == [3.0]
    assert _threshold(backend, z, 0, 0.01).tolist() == [5.0]  # at least the largest
    assert _threshold(backend, z, 2, 0.99).tolist() == [3.0]  # top-p over the top-k set, ties kept


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rows_threshold_is_the_same_alone_and_in_any_batch(backend, gen, monkeypatch):
    for candidates in (1024, 4) if backend == "torch" else (4,):
        _small_chunks(monkeypatch, candidates)
        n = 19 if backend == "torch" else 5
        z = _scaled_logits(n, 301, gen, std=3.0)
        full = _threshold(backend, z, 0, 0.95)
        for rows in (torch.tensor([n - 1]), torch.tensor([n - 1, 0, 2, 2]), torch.randperm(n, generator=gen)):
            part = _threshold(backend, z[rows], 0, 0.95)
            assert torch.equal(part.view(torch.int32), full[rows].view(torch.int32))


def test_neutral_values_do_not_truncate():
    assert not truncates(0, 1.0, 100)
    assert not truncates(100, 1.0, 100) and not truncates(1000, 1.0, 100)
    assert truncates(99, 1.0, 100) and truncates(0, 0.99, 100)
    z = torch.randn(3, 10)
    assert torch.isneginf(top_k_floor(z, 0)).all() and torch.isneginf(top_k_floor(z, 10)).all()


@pytest.mark.parametrize("top_k, top_p, err, match", [
    (-1, 1.0, ValueError, r"top_k must be >= 0 \(0 keeps every token\), got -1"),
    (1.5, 1.0, TypeError, r"top_k must be an int \(0 keeps every token\), got 1.5"),
    (True, 1.0, TypeError, r"top_k must be an int"),
    (0, 0.0, ValueError, r"top_p must lie in \(0, 1\] \(1 keeps every token\), got 0.0"),
    (0, 1.5, ValueError, r"top_p must lie in \(0, 1\]"),
    (0, float("nan"), ValueError, r"top_p must lie in \(0, 1\]"),
    (0, "0.9", TypeError, r"top_p must be a number in \(0, 1\]"),
    (0, None, TypeError, r"top_p must be a number in \(0, 1\]"),
])
def test_bad_truncation_is_refused_naming_the_op(top_k, top_p, err, match):
    with pytest.raises(err, match=rf"rlkernels.some_op: {match}"):
        validate_truncation("some_op", top_k, top_p)
