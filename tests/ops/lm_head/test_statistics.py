"""The Triton statistics pass over stored logits: a truncated read that skips the tiles
wholly below a row's threshold gives the full read's bits (TRITON_INTERPRET=1)."""
from __future__ import annotations

import math

import pytest
import torch

from rlkernels._env import triton_interpret
from rlkernels.kernels._triton import cdiv
from rlkernels.ops.lm_head.config import LogitTransform
from rlkernels.ops.lm_head.lse import LSE_TILE
from rlkernels.ops.lm_head.statistics import TileRecord, TritonHeadStatistics
from rlkernels.ops.lm_head.truncation import threshold, tile_maxima

from ...conftest import randn

kernels_only = pytest.mark.skipif(not triton_interpret(), reason="the Triton kernels run under TRITON_INTERPRET=1")


def _pass(stats, h, w, raw, tau, temperature, transform, tile_max=None):
    """Every output of the sampler's pass as int32 bit patterns: per-split (m, s, u), then
    each tile's running max and mass."""
    N, V = raw.shape
    n_tiles = stats.n_tiles(V, h.dtype)
    tiles = TileRecord(torch.zeros(N * n_tiles), torch.zeros(N * n_tiles))  # tiles past V stay 0
    m, s, u, _ = stats.tile_statistics(h, w, None, temperature, tiles, threshold=tau, transform=transform,
                                       logits=raw, tile_max=tile_max)
    return [t.contiguous().view(torch.int32) for t in (m, s, u, *tiles)], s


@kernels_only
@pytest.mark.parametrize("temperature, transform", [(0.8, LogitTransform()), (0.7, LogitTransform(0.5, 20.0))],
                         ids=["plain", "scaled-capped"])
def test_skipping_tiles_below_the_threshold_keeps_the_full_reads_bits(temperature, transform, gen):
    stats = TritonHeadStatistics()
    N, D, V = 5, 8, 4 * LSE_TILE + 77  # a last, partial tile
    h, w = randn(N, D, generator=gen), randn(V, D, generator=gen)
    raw = randn(N, V, generator=gen, scale=6.0)  # the pass reads these, not h @ w.T
    raw[0, 300] = 80.0  # one logit holds the row's mass: one tile read
    raw[1] *= 0.02  # flat: every tile holds kept logits
    raw[3, 2 * LSE_TILE + 5] = math.nan  # a NaN in a tile otherwise below the threshold
    z = TritonHeadStatistics.scores(raw, temperature, transform)
    tau = threshold(z.nan_to_num(nan=-math.inf), 0, 0.9)
    tile_max = tile_maxima(z)
    assert tile_max.shape == (N, cdiv(V, LSE_TILE)) and torch.isnan(tile_max[3, 2])
    below = tile_max < tau[:, None]
    assert below.sum() >= 6 and (~below).sum() >= 6  # tiles skipped and tiles read

    full, s_full = _pass(stats, h, w, raw, tau, temperature, transform)
    skipped, s_skipped = _pass(stats, h, w, raw, tau, temperature, transform, tile_max)
    for got, want in zip(skipped, full):
        assert torch.equal(got, want)
    assert torch.isnan(s_full[:, 3]).any()  # the NaN was read: the row is refused downstream

    # Controls: a map that calls a kept tile below the threshold changes the row's mass, and
    # one whose max ignored the NaN (as a plain max may) loses the NaN.
    wrong = tile_max.clone()
    wrong[1, 0] = -math.inf
    assert not torch.equal(_pass(stats, h, w, raw, tau, temperature, transform, wrong)[0][1], full[1])
    wrong = tile_max.clone()
    wrong[3, 2] = -math.inf
    assert not torch.isnan(_pass(stats, h, w, raw, tau, temperature, transform, wrong)[1][:, 3]).any()


@kernels_only
def test_a_tile_map_of_the_wrong_shape_is_refused(gen):
    stats = TritonHeadStatistics()
    h, w, raw = randn(2, 4, generator=gen), randn(300, 4, generator=gen), randn(2, 300, generator=gen)
    tau = torch.zeros(2)
    with pytest.raises(ValueError, match=r"tile_max must be \[N, ceil\(V / 256\)\] = \[2, 2\], got \(2, 3\)"):
        _pass(stats, h, w, raw, tau, 1.0, LogitTransform(), torch.zeros(2, 3))
