"""Top-k / top-p thresholds: the kept set against a float64 sort-based reference.

Both backends (the Triton kernel under TRITON_INTERPRET=1), through the nucleus's
candidates and through the whole-row search (a candidate count of 4 forces it).
Logits at a trained model's scale (std ~6).
"""
from __future__ import annotations

import math

import pytest
import torch

from rlkernels._env import triton_interpret
from rlkernels.ops.lm_head import truncation as TR
from rlkernels.ops.lm_head.truncation import split_p, threshold, top_k_floor, truncates, validate_truncation

from ...conftest import randn

BACKENDS = ["torch"] + (["triton"] if triton_interpret() else [])


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("candidates", [1024, 4])
@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.9), (0, 0.5), (40, 0.8), (3, 0.999), (0, 0.999999),
                                          (0, 1e-6), (1, 0.9)])
def test_the_threshold_is_the_sorted_references(backend, candidates, top_k, top_p, gen, monkeypatch):
    monkeypatch.setattr(TR, "TOP_P_CANDIDATES", candidates)
    z = _scaled_logits(37, 257, gen)
    tau = threshold(z, top_k, top_p, backend)
    want, margin = reference_threshold(z, top_k, top_p)
    clear = margin > 1e-12
    assert clear.sum() >= 30
    assert torch.equal(tau.double()[clear], want[clear])
    kept = z >= tau[:, None]
    assert (kept.sum(dim=1) >= 1).all()  # the largest logit is always kept
    if top_k:
        assert (kept.sum(dim=1) <= top_k).all()  # no ties at these values


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_at_the_border_are_kept(backend):
    z = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0, -2.0, -7.0]])
    floor = top_k_floor(z, 2)
    assert floor.tolist() == [3.0]
    assert (z >= floor[:, None]).sum() == 4  # the k-th's ties are kept
    # Masses 0.70, 0.095 each for the 3.0s: p = 0.8 is reached at the second 3.0, and the
    # third, its tie, is kept too; nothing below.
    assert threshold(z, 0, 0.8, backend).tolist() == [3.0]
    assert threshold(z, 0, 0.01, backend).tolist() == [5.0]  # at least the largest
    assert threshold(z, 2, 0.99, backend).tolist() == [3.0]  # top-p over the top-k set, ties kept


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rows_threshold_is_the_same_alone_and_in_any_batch(backend, gen, monkeypatch):
    for candidates in (1024, 4):
        monkeypatch.setattr(TR, "TOP_P_CANDIDATES", candidates)
        z = _scaled_logits(19, 301, gen, std=3.0)
        full = threshold(z, 0, 0.95, backend)
        for rows in (torch.tensor([7]), torch.tensor([18, 0, 7, 7]), torch.randperm(19, generator=gen)):
            part = threshold(z[rows], 0, 0.95, backend)
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
