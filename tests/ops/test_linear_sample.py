"""linear_sample: exact draws from the fp32 head distribution, linear_logprob's bits, row invariance.

CPU: the torch backend always; the Triton kernels under TRITON_INTERPRET=1 (fp32/fp16).
GPU tests (``-m gpu``) run the real sizes and bf16. Logits are scaled to a trained
model's (std ~6), where rounding them to bf16 moves probabilities by percents.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlkernels import linear_logprob, linear_sample
from rlkernels._env import triton_interpret
from rlkernels.ops.linear_sample import gumbel_from_words, noise_words, philox4x32
from rlkernels.ops.lm_head.config import LogitTransform
from rlkernels.reference import linear_logprob_ref

from ..conftest import cpu_backend_cases, randn

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SEED = 20261127


def _head(n, d, v, dtype, gen, *, bias=True, device="cpu", logit_std=6.0):
    h = randn(n, d, dtype=dtype, generator=gen, device=device)
    w = randn(v, d, dtype=dtype, generator=gen, scale=logit_std / d ** 0.5, device=device)
    b = randn(v, dtype=dtype, generator=gen, device=device) if bias else None
    return h, w, b


def _counters(n, gen, device="cpu"):
    streams = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen).to(device)
    positions = torch.randint(0, 1 << 32, (n,), generator=gen).to(device)
    return streams, positions


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == F32 else t.view(torch.int64)


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(Pearson's statistic of ``counts`` [V] against probabilities ``p`` [V] over the ids
    expected 5+ times, its critical value at p = 1e-4 by Wilson-Hilferty)."""
    n = float(counts.sum())
    keep = p * n >= 5
    df = int(keep.sum()) - 1
    stat = float(((counts[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum())
    return stat, df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3


def _accepts(counts: torch.Tensor, p: torch.Tensor) -> bool:
    stat, critical = _chi_square(counts, p)
    return stat < critical


# ------------------------------------------------------------------ the generator


def test_philox_matches_the_published_known_answers():
    """Random123's kat_vectors for philox4x32-10 (counter, key -> output)."""
    def run(ctr, key):
        c = [torch.tensor([v], dtype=torch.int64) for v in ctr]
        return [int(x) for x in philox4x32(*c, *key)]

    assert run([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert run([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert run([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]) == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
def test_the_kernel_generator_is_the_torch_one():
    """Triton's philox (the kernel's) gives the torch backend's words, counter for counter."""
    import triton
    import triton.language as tl

    @triton.jit
    def words_kernel(out_ptr, c1, c2, c3, k0, k1, BLOCK: tl.constexpr):
        q = tl.arange(0, BLOCK).to(tl.uint32)
        z = tl.zeros((BLOCK,), tl.uint32)
        r0, r1, r2, r3 = tl.philox_impl(q, z + c1.to(tl.uint32), z + c2.to(tl.uint32), z + c3.to(tl.uint32),
                                        k0.to(tl.uint32), k1.to(tl.uint32), 10)
        x = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
        tl.store(out_ptr + tl.arange(0, 4 * BLOCK), x.to(tl.int64) & 0xFFFFFFFF)

    seed, stream, position = 0x1234_5678_9ABC_DEF0, -0x0FED_CBA9_8765_4321, 77
    out = torch.empty(64, dtype=torch.int64)
    words_kernel[(1,)](out, position, stream & 0xFFFFFFFF, (stream >> 32) & 0xFFFFFFFF,
                       seed & 0xFFFFFFFF, seed >> 32, BLOCK=16)
    ref = noise_words(seed, torch.tensor([stream]), torch.tensor([position]), 0, 64)[0]
    assert torch.equal(out, ref)


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("greedy", [False, True])
def test_the_backends_draw_the_same_tokens(greedy, gen):
    """One definition: blocks of 256 ids drawn by their mass, then a Gumbel-max inside. The
    kernels record masses per 64-id tile (fp32) and the torch backend per 256-id tile."""
    n, d, v = 9, 24, 700
    h, w, b = _head(n, d, v, F32, gen)
    streams, positions = _counters(n, gen)
    kw = dict(temperature=0.9, greedy=greedy) if greedy else \
        dict(temperature=0.9, seed=SEED, streams=streams, positions=positions)
    tok_torch, _ = linear_sample(h, w, b, backend="torch", **kw)
    tok_triton, _ = linear_sample(h, w, b, backend="triton", **kw)
    assert torch.equal(tok_torch, tok_triton)


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32,)))
def test_a_seed_tensor_draws_the_int_seeds_bits(backend, dtype, gen):
    """A one-element int64 seed tensor keys the generator with its int64's two 32-bit
    words: the same tokens, log-probs and entropies as the int, for seeds whose words
    have their top bits set too."""
    n, d, v = 9, 24, 700
    h, w, b = _head(n, d, v, dtype, gen)
    streams, positions = _counters(n, gen)
    kw = dict(temperature=0.9, streams=streams, positions=positions, return_entropy=True, backend=backend)
    draws = set()
    for seed in (0, SEED, 0xFFFF_FFFF, 0x8000_0000, (1 << 63) - 1, 0x7FFF_FFFF_8000_0001):
        want = linear_sample(h, w, b, seed=seed, **kw)
        for tensor in (torch.tensor(seed), torch.tensor([seed]), torch.tensor([[7, seed]])[:, 1]):
            got = linear_sample(h, w, b, seed=tensor, **kw)
            assert torch.equal(got[0], want[0]) and torch.equal(_bits(got[1]), _bits(want[1])) \
                and torch.equal(_bits(got[2]), _bits(want[2])), (seed, tensor.shape)
        draws.add(tuple(want[0].tolist()))
    assert len(draws) == 6  # every seed draws its own tokens
    # Greedy reads no seed: a tensor is accepted and changes nothing.
    greedy = linear_sample(h, w, b, temperature=0.9, greedy=True, backend=backend)
    assert torch.equal(linear_sample(h, w, b, temperature=0.9, greedy=True, seed=torch.tensor(5),
                                     backend=backend)[0], greedy[0])


def test_noise_is_gumbel_with_both_tails():
    x = torch.tensor([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF], dtype=torch.int64)
    g = gumbel_from_words(x).double()
    u = (x.double() + 0.5) / 2 ** 32
    assert torch.allclose(g, -torch.log(-torch.log(u)), rtol=1e-6, atol=1e-6)
    assert g[0] < -3.0 and g[-1] > 22.0  # the far tails are reached, not cut at fp32's 2^-24


# ------------------------------------------------------------------ the contract


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
@pytest.mark.parametrize("n, d, v, bias, temperature", [(7, 40, 257, True, 0.7), (1, 33, 131, False, 1.0),
                                                        (13, 16, 64, True, 1.3)])
def test_logp_and_entropy_are_linear_logprobs_bits(backend, dtype, n, d, v, bias, temperature, gen):
    h, w, b = _head(n, d, v, dtype, gen, bias=bias)
    streams, positions = _counters(n, gen)
    tok, lp, ent = linear_sample(h, w, b, temperature=temperature, seed=SEED, streams=streams, positions=positions,
                                 return_entropy=True, backend=backend)
    assert tok.dtype == torch.int64 and ((tok >= 0) & (tok < v)).all()
    ref_lp, ref_ent = linear_logprob(h, w, tok, b, temperature=temperature, return_entropy=True, backend=backend)
    assert torch.equal(_bits(lp), _bits(ref_lp)) and torch.equal(_bits(ent), _bits(ref_ent))
    greedy, glp = linear_sample(h, w, b, temperature=temperature, greedy=True, backend=backend)
    z = (h.double() @ w.double().T + (b.double() if bias else 0)) / temperature
    top2 = z.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # rows whose argmax no fp32 rounding can move
    assert torch.equal(greedy[clear], z.argmax(dim=1)[clear])
    assert torch.equal(_bits(glp), _bits(linear_logprob(h, w, greedy, b, temperature=temperature, backend=backend)))


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
@pytest.mark.parametrize("truncation", [{}, dict(top_k=30, top_p=0.9, return_threshold=True)],
                         ids=["full", "truncated"])
def test_a_rows_token_is_the_same_alone_in_any_batch_and_order(backend, dtype, truncation, gen):
    n, d, v = 11, 24, 197
    h, w, b = _head(n, d, v, dtype, gen)
    streams, positions = _counters(n, gen)

    def draw(rows):
        return linear_sample(h[rows], w, b, temperature=0.8, seed=SEED, streams=streams[rows],
                             positions=positions[rows], return_entropy=True, backend=backend, **truncation)

    full = draw(torch.arange(n))
    for rows in (torch.tensor([4]), torch.tensor([10, 0, 3]), torch.randperm(n, generator=gen),
                 torch.arange(n).repeat(3)):
        part = draw(rows)
        for got, want in zip(part, full):
            assert torch.equal(got.view(torch.int64) if got.dtype == torch.int64 else _bits(got), _bits(want[rows]))


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32,)))
def test_the_key_decides_the_draw(backend, dtype, gen):
    n, d, v = 64, 16, 96
    h, w, b = _head(1, d, v, dtype, gen, logit_std=0.5)  # a flat distribution: many tokens are likely
    h = h.expand(n, d)
    streams = torch.zeros(n, dtype=torch.int64)

    def draw(seed, streams, positions):
        return linear_sample(h, w, b, seed=seed, streams=streams, positions=positions, backend=backend)[0]

    positions = torch.arange(n)
    base = draw(SEED, streams, positions)
    assert torch.equal(base, draw(SEED, streams, positions))            # run to run
    assert len(set(base.tolist())) > 8                                  # positions draw apart
    assert not torch.equal(base, draw(SEED + 1, streams, positions))    # the seed matters
    assert not torch.equal(base, draw(SEED, streams + (1 << 32), positions))  # a stream's high word too
    same_pos = draw(SEED, torch.arange(n), torch.zeros(n, dtype=torch.int64))
    assert len(set(same_pos.tolist())) > 8                              # streams draw apart
    assert torch.equal(same_pos, draw(SEED, torch.arange(n), None))     # no positions: position 0


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32,)))
def test_ties_go_to_the_lowest_id(backend, dtype):
    d, v = 8, 300
    w = torch.zeros(v, d, dtype=dtype)
    w[[5, 77, 260]] = 1.0  # three equal largest logits, in different vocabulary splits
    h = torch.ones(3, d, dtype=dtype)
    tok, _ = linear_sample(h, w, greedy=True, backend=backend)
    assert tok.tolist() == [5, 5, 5]


def test_draws_follow_the_fp32_distribution_and_not_the_bf16_rounded_one():
    """Chi-square of 200k draws against exp(linear_logprob); the same draws reject bf16(z).

    Two-term logits 8.0625 k +- 0.03: each sits 0.03 from a bf16 value, alternately above
    and below, so rounding them moves neighbouring probability ratios by ~6%."""
    v, n = 16, 200_000
    k = torch.arange(v, dtype=torch.float64)
    w = torch.stack([8.0 + 0.0625 * k - 0.5 * (k - 8).abs(), 0.03 * (-1.0) ** k], dim=1).float()
    h = torch.ones(1, 2)
    z32 = (h @ w.T)[0]
    assert not torch.equal(z32, z32.bfloat16().float())  # the logits are not bf16 values
    tok, _ = linear_sample(h.expand(n, 2), w, seed=SEED, streams=torch.arange(n),
                           positions=torch.full((n,), 5), backend="torch")
    counts = torch.bincount(tok, minlength=v).double()
    exact = torch.stack([linear_logprob(h, w, torch.tensor([j]), backend="torch")[0] for j in range(v)]).double().exp()
    rounded = torch.softmax(z32.bfloat16().double(), 0)

    assert _accepts(counts, exact), _chi_square(counts, exact)
    assert not _accepts(counts, rounded), _chi_square(counts, rounded)


# ------------------------------------------------------------------ top-k and top-p

TRUNCATIONS = [dict(top_k=5), dict(top_p=0.9), dict(top_k=40, top_p=0.8)]


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=["top_k", "top_p", "both"])
def test_truncated_logp_is_linear_logprobs_with_the_threshold(backend, dtype, truncation, gen):
    n, d, v = 9, 40, 257
    h, w, b = _head(n, d, v, dtype, gen)
    streams, positions = _counters(n, gen)
    tok, lp, ent, tau = linear_sample(h, w, b, temperature=0.7, seed=SEED, streams=streams, positions=positions,
                                      return_entropy=True, return_threshold=True, backend=backend, **truncation)
    assert tau.dtype == F32 and tau.shape == (n,) and torch.isfinite(tau).all()
    z = linear_logprob  # the kept set as the trainer sees it: the token is inside it
    ref_lp, ref_ent = z(h, w, tok, b, temperature=0.7, return_entropy=True, logit_threshold=tau, backend=backend)
    assert torch.equal(_bits(lp), _bits(ref_lp)) and torch.equal(_bits(ent), _bits(ref_ent))
    full_lp = linear_logprob(h, w, tok, b, temperature=0.7, backend=backend)
    assert (lp >= full_lp).all() and (lp > full_lp).any()  # renormalised over fewer tokens
    greedy, glp, gtau = linear_sample(h, w, b, temperature=0.7, greedy=True, return_threshold=True, backend=backend,
                                      **truncation)
    assert torch.equal(_bits(gtau), _bits(tau))  # the threshold does not depend on the draw
    assert torch.equal(_bits(glp), _bits(linear_logprob(h, w, greedy, b, temperature=0.7, logit_threshold=tau,
                                                        backend=backend)))


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32,)))
def test_neutral_truncation_gives_the_untruncated_bits(backend, dtype, gen):
    n, d, v = 7, 16, 131
    h, w, b = _head(n, d, v, dtype, gen)
    streams, positions = _counters(n, gen)
    base = linear_sample(h, w, b, seed=SEED, streams=streams, positions=positions, return_entropy=True,
                         backend=backend)
    for neutral in (dict(top_k=0, top_p=1.0), dict(top_k=v), dict(top_k=10 * v, top_p=1)):
        *got, tau = linear_sample(h, w, b, seed=SEED, streams=streams, positions=positions, return_entropy=True,
                                  return_threshold=True, backend=backend, **neutral)
        assert torch.isneginf(tau).all()
        for x, y in zip(got, base):
            assert torch.equal(x.view(torch.int64) if x.dtype == torch.int64 else _bits(x), _bits(y))


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32,)))
def test_a_truncated_call_in_row_blocks_gives_the_one_block_bits(backend, dtype, gen, monkeypatch):
    import rlkernels.ops.linear_sample as sampler

    h, w, b = _head(13, 16, 97, dtype, gen)
    streams, positions = _counters(13, gen)
    kw = dict(seed=SEED, streams=streams, positions=positions, top_p=0.9, return_entropy=True,
              return_threshold=True, backend=backend)
    whole = linear_sample(h, w, b, **kw)
    monkeypatch.setattr(sampler, "TRUNCATED_ROWS", 4)  # [rows, V] logits 4 rows at a time
    for got, want in zip(linear_sample(h, w, b, **kw), whole):
        assert torch.equal(got.view(torch.int64) if got.dtype == torch.int64 else _bits(got), _bits(want))


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
def test_a_given_threshold_draws_what_top_k_top_p_drew_with_it_and_rows_are_invariant(backend, dtype, gen):
    n, d, v = 9, 40, 257
    h, w, b = _head(n, d, v, dtype, gen)
    streams, positions = _counters(n, gen)
    kw = dict(temperature=0.7, seed=SEED, streams=streams, positions=positions, return_entropy=True,
              return_threshold=True, backend=backend)
    want = linear_sample(h, w, b, top_k=40, top_p=0.8, **kw)
    tau = want[3].clone()
    tau[2] = -math.inf  # a row that keeps every logit: the untruncated draw's bits
    got = linear_sample(h, w, b, logit_threshold=tau, **kw)
    full = linear_sample(h, w, b, **kw)
    for i, (x, y, f) in enumerate(zip(got, want, full)):
        bits = (lambda t: t) if x.dtype == torch.int64 else _bits
        if i < 3:
            assert torch.equal(bits(x[[0, 1, 3]]), bits(y[[0, 1, 3]])) and torch.equal(bits(x[2]), bits(f[2]))
    assert torch.equal(_bits(got[3]), _bits(tau))
    for rows in (torch.tensor([4]), torch.tensor([8, 0, 2, 2])):
        part = linear_sample(h[rows], w, b, logit_threshold=tau[rows], **dict(kw, streams=streams[rows],
                                                                              positions=positions[rows]))
        for x, y in zip(part, got):
            assert torch.equal(x if x.dtype == torch.int64 else _bits(x), y[rows] if y.dtype == torch.int64
                               else _bits(y[rows]))


def test_a_given_threshold_is_refused_with_top_k_top_p_or_the_wrong_shape_or_dtype(gen):
    h, w, b = _head(4, 16, 97, F32, gen)
    streams, positions = _counters(4, gen)
    kw = dict(seed=SEED, streams=streams, positions=positions, backend="torch")
    tau = torch.full((4,), -math.inf)
    with pytest.raises(ValueError, match=r"rlkernels.linear_sample: logit_threshold gives the kept set itself"):
        linear_sample(h, w, b, logit_threshold=tau, top_p=0.9, **kw)
    with pytest.raises(ValueError, match=r"rlkernels.linear_sample: logit_threshold shape \(3,\) must equal \(4,\)"):
        linear_sample(h, w, b, logit_threshold=tau[:3], **kw)
    with pytest.raises(ValueError, match=r"logit_threshold must be torch.float32"):
        linear_sample(h, w, b, logit_threshold=tau.double(), **kw)
    with pytest.raises(TypeError, match=r"rlkernels.linear_sample: logit_threshold must be a tensor"):
        linear_sample(h, w, b, logit_threshold=0.5, **kw)
    tau[1] = math.inf  # keeps nothing: not a distribution
    with pytest.raises(ValueError, match=r"rlkernels.linear_sample: row 1's logits are not a distribution"):
        linear_sample(h, w, b, logit_threshold=tau, **kw)


def _two_term_head(v):
    """Logits 8.0625 k - 0.5 |k - 8| +- 0.03 over k < v: none a bf16 value, a peaked distribution."""
    k = torch.arange(v, dtype=torch.float64)
    w = torch.stack([8.0 + 0.0625 * k - 0.5 * (k - 8).abs(), 0.03 * (-1.0) ** k], dim=1).float()
    return torch.ones(1, 2), w


@pytest.mark.parametrize("truncation", [dict(top_k=4), dict(top_p=0.7), dict(top_k=6, top_p=0.6)],
                         ids=["top_k", "top_p", "both"])
def test_truncated_draws_follow_the_truncated_fp64_distribution(truncation):
    """Chi-square of 100k draws at T = 0.7 against the fp64 truncated distribution (the kept
    set from the returned threshold, checked against the fp64 definition); the same draws
    reject the untruncated distribution."""
    v, n, T = 16, 100_000, 0.7
    h, w = _two_term_head(v)
    tok, _, tau = linear_sample(h.expand(n, 2), w, temperature=T, seed=SEED, streams=torch.arange(n),
                                positions=torch.full((n,), 3), return_threshold=True, backend="torch", **truncation)
    assert (tau == tau[0]).all()
    # The fp32 scaled logits the op draws from (two exact products, one rounded add, / T),
    # and the kept set on them; probabilities in fp64 of those values.
    z32 = (w[:, 0] + w[:, 1]) / T
    kept = z32 >= tau[0]
    z = z32.double()
    order = torch.sort(z, descending=True).values
    k = truncation.get("top_k", 0)
    floor = order[k - 1] if k else -math.inf
    p_k = torch.softmax(torch.where(z >= floor, z, -math.inf), 0)
    mass = torch.cumsum(torch.sort(p_k, descending=True).values, 0)
    want = int((mass < truncation.get("top_p", 1.0) - 1e-12).sum()) + 1 if "top_p" in truncation else k
    assert int(kept.sum()) == want  # the kept set is the fp64 definition's
    truncated = torch.softmax(torch.where(kept, z, -math.inf), 0)
    counts = torch.bincount(tok, minlength=v).double()
    assert counts[~kept].sum() == 0

    assert _accepts(counts, truncated), _chi_square(counts, truncated)
    full = torch.softmax(z, 0)
    assert not _accepts(counts, full), _chi_square(counts, full)


# ------------------------------------------------------------------ a model's logit transform

CAPPED = dict(logit_scale=2.0, logit_softcap=6.0)  # past the cap at a trained head's spread


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32, F16)))
@pytest.mark.parametrize("truncation", [{}, dict(top_k=40, top_p=0.8)], ids=["full", "truncated"])
def test_a_transformed_draws_logp_is_linear_logprobs_and_rows_are_invariant(backend, dtype, truncation, gen):
    n, d, v = 9, 40, 257
    h, w, b = _head(n, d, v, dtype, gen)
    streams, positions = _counters(n, gen)
    kw = dict(temperature=0.7, streams=streams, positions=positions, return_entropy=True, return_threshold=True,
              backend=backend, **CAPPED, **truncation)
    tok, lp, ent, tau = linear_sample(h, w, b, seed=SEED, **kw)
    ref_lp, ref_ent = linear_logprob(h, w, tok, b, temperature=0.7, return_entropy=True, backend=backend,
                                     logit_threshold=tau if truncation else None, **CAPPED)
    assert torch.equal(_bits(lp), _bits(ref_lp)) and torch.equal(_bits(ent), _bits(ref_ent))
    rows = torch.tensor([6, 0, 3])
    kw.update(streams=streams[rows], positions=positions[rows])
    for got, want in zip(linear_sample(h[rows], w, b, seed=SEED, **kw), (tok, lp, ent, tau)):
        assert torch.equal(got.view(torch.int64) if got.dtype == torch.int64 else _bits(got), _bits(want[rows])
                           if want.dtype != torch.int64 else want[rows])


def test_transformed_draws_follow_the_capped_fp64_distribution():
    """Chi-square of 100k draws at T = 0.7 against softmax(c tanh(s x / c) / T) in fp64; the
    same draws reject the uncapped distribution softmax(s x / T)."""
    v, n, T, s, c = 16, 100_000, 0.7, 1.5, 9.0
    h, w = _two_term_head(v)  # raw logits up to 10 (15 scaled): the cap binds at the top
    tok, _ = linear_sample(h.expand(n, 2), w, temperature=T, seed=SEED, streams=torch.arange(n),
                           positions=torch.full((n,), 3), backend="torch", logit_scale=s, logit_softcap=c)
    x = (w[:, 0] + w[:, 1]).double() * s
    capped, plain = torch.softmax(c * torch.tanh(x / c) / T, 0), torch.softmax(x / T, 0)
    counts = torch.bincount(tok, minlength=v).double()
    assert _accepts(counts, capped), _chi_square(counts, capped)
    assert not _accepts(counts, plain), _chi_square(counts, plain)


@pytest.mark.parametrize("kw, match", [
    (dict(logit_scale=0), r"logit_scale must be a finite number > 0"),
    (dict(logit_softcap=-3.0), r"logit_softcap must be a finite number >= 0"),
    (dict(logit_softcap="30"), r"logit_softcap must be a Python number, got str"),
])
def test_bad_logit_transforms_are_refused_by_the_sampler(kw, match, gen):
    h, w, b = _head(3, 8, 30, F32, gen)
    with pytest.raises((TypeError, ValueError), match=rf"rlkernels.linear_sample: {match}"):
        linear_sample(h, w, b, seed=SEED, streams=torch.arange(3), **kw)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(top_k=-1), ValueError, r"top_k must be >= 0"),
    (dict(top_k=2.0), TypeError, r"top_k must be an int"),
    (dict(top_p=0.0), ValueError, r"top_p must lie in \(0, 1\]"),
    (dict(top_p=float("nan")), ValueError, r"top_p must lie in \(0, 1\]"),
    (dict(top_p="high"), TypeError, r"top_p must be a number"),
])
def test_bad_truncation_is_refused_naming_the_op(kwargs, err, match, gen):
    h, w, b = _head(4, 8, 40, F32, gen)
    with pytest.raises(err, match=rf"rlkernels.linear_sample: {match}"):
        linear_sample(h, w, b, seed=1, streams=torch.arange(4), **kwargs)


# ------------------------------------------------------------------ edges and refusals


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32,)))
def test_empty_batches_and_leading_shapes(backend, dtype, gen):
    h, w, b = _head(6, 8, 50, dtype, gen)
    tok, lp = linear_sample(h[:0], w, b, seed=1, streams=torch.zeros(0, dtype=torch.int64), backend=backend)
    assert tok.shape == (0,) and lp.shape == (0,)
    h3 = h.reshape(2, 3, 8)
    streams = torch.arange(6).reshape(2, 3)
    tok3, lp3 = linear_sample(h3, w, b, seed=1, streams=streams, backend=backend)
    tok2, lp2 = linear_sample(h, w, b, seed=1, streams=streams.reshape(6), backend=backend)
    assert torch.equal(tok3.reshape(6), tok2) and torch.equal(lp3.reshape(6), lp2)


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32,)))
def test_outputs_carry_no_graph(backend, dtype, gen):
    h, w, b = _head(3, 8, 40, dtype, gen)
    h.requires_grad_(True)
    w.requires_grad_(True)
    tok, lp, ent = linear_sample(h, w, b, seed=1, streams=torch.arange(3), return_entropy=True, backend=backend)
    assert not lp.requires_grad and not ent.requires_grad and lp.grad_fn is None


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32,)))
def test_a_row_with_nan_logits_is_refused(backend, dtype, gen):
    h, w, b = _head(4, 8, 40, dtype, gen)
    h[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"linear_sample: row 2's logits are not a distribution"):
        linear_sample(h, w, b, seed=1, streams=torch.arange(4), backend=backend)
    with pytest.raises(RuntimeError):  # stock refuses the same row
        torch.multinomial(torch.softmax(h @ w.T + b, -1), 1)


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
def test_the_kernels_flag_a_call_with_a_refused_row(gen):
    """The one-element flag the CUDA check asserts on: 1 where every row is fine, else 0."""
    from rlkernels.ops.linear_sample import STATUS_BAD_POSITION, STATUS_NOT_A_DISTRIBUTION, TritonLinearSampleBackend

    h, w, b = _head(5, 8, 40, F32, gen)
    streams, positions = torch.arange(5), torch.arange(5)
    draw = TritonLinearSampleBackend().sample
    fine = draw(h, w, b, 1.0, 1, streams, positions, False)
    assert fine.ok.tolist() == [1] and fine.status.tolist() == [0] * 5
    bad = positions.clone()
    bad[3] = 1 << 32
    flagged = draw(h, w, b, 1.0, 1, streams, bad, False)
    assert flagged.ok.tolist() == [0] and flagged.status.tolist() == [0, 0, 0, STATUS_BAD_POSITION, 0]
    assert torch.equal(flagged.token[:3], fine.token[:3])
    h[1, 2] = float("nan")
    for greedy in (False, True):
        nan = draw(h, w, b, 1.0, 1, streams, positions, greedy)
        assert nan.ok.tolist() == [0] and nan.status.tolist() == [0, STATUS_NOT_A_DISTRIBUTION, 0, 0, 0]


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(seed=-1), ValueError, r"seed must be in \[0, 2\^63\), got -1"),
    (dict(seed=1 << 63), ValueError, r"seed must be in \[0, 2\^63\)"),
    (dict(seed=True), TypeError, r"seed must be a Python int or a one-element int64 tensor, got bool"),
    (dict(seed=None), TypeError, r"seed must be a Python int or a one-element int64 tensor, got NoneType"),
    (dict(seed=1.0), TypeError, r"seed must be a Python int or a one-element int64 tensor, got float"),
    (dict(seed=torch.tensor(1, dtype=torch.int32)), ValueError, r"a seed tensor must be int64, got torch.int32"),
    (dict(seed=torch.tensor([1, 2])), ValueError, r"a seed tensor must hold one element, got shape \(2,\)"),
    (dict(seed=torch.tensor(1, device="meta")), ValueError, r"the seed tensor is on meta, hidden on cpu"),
    (dict(seed=torch.tensor([-3])), ValueError, r"seed must be in \[0, 2\^63\), got -3"),
    (dict(streams=torch.arange(4, dtype=torch.int32)), ValueError, r"streams must be int64, got torch.int32"),
    (dict(streams=torch.arange(3)), ValueError, r"streams shape \(3,\) must equal hidden's leading shape \(4,\)"),
    (dict(streams=None), TypeError, r"sampling needs streams, an int64 tensor of hidden's leading shape \(4,\)"),
    (dict(positions=torch.tensor([0, 1, -1, 2])), ValueError, r"positions must lie in \[0, 2\^32\), got -1 at flat row 2"),
    (dict(positions=torch.tensor([0, 1, 2, 1 << 32])), ValueError, r"positions must lie in \[0, 2\^32\)"),
    (dict(temperature=0.0), ValueError, r"temperature must be a finite number > 0"),
    (dict(temperature=float("nan")), ValueError, r"temperature must be a finite number > 0"),
    (dict(temperature=1e-40), ValueError, r"temperature must be >= 0.0001, got 1e-40: below it the distribution"),
    (dict(seed=np.int64(5)), TypeError, r"seed must be a Python int .*got numpy.int64 \(pass int\(seed\)\)"),
])
def test_bad_inputs_are_refused_naming_the_op(kwargs, err, match, gen):
    h, w, b = _head(4, 8, 40, F32, gen)
    call = dict(seed=1, streams=torch.arange(4), temperature=1.0)
    call.update(kwargs)
    with pytest.raises(err, match=rf"rlkernels.linear_sample: {match}"):
        linear_sample(h, w, b, **call)


def test_meta_tensors_give_the_results_shapes_and_dtypes():
    # As torch's ops do on meta tensors (a shape pass, a fake-tensor trace): no values, no
    # kernel; an operator without a meta kernel was reached before.
    for dtype, logp_dtype in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        h = torch.empty(3, 5, 16, dtype=dtype, device="meta")
        w = torch.empty(40, 16, dtype=dtype, device="meta")
        streams = torch.empty(3, 5, dtype=torch.int64, device="meta")
        token, logp, ent = linear_sample(h, w, seed=1, streams=streams, return_entropy=True)
        assert all(t.is_meta and t.shape == (3, 5) for t in (token, logp, ent))
        assert (token.dtype, logp.dtype, ent.dtype) == (torch.int64, logp_dtype, logp_dtype)
        assert linear_sample(h, w, greedy=True)[0].shape == (3, 5)


def test_head_shape_mismatches_are_refused(gen):
    h, w, b = _head(4, 8, 40, F32, gen)
    with pytest.raises(ValueError, match=r"linear_sample: hidden \(4, 7\) has D=7"):
        linear_sample(h[:, :7], w, b, seed=1, streams=torch.arange(4))
    with pytest.raises(ValueError, match=r"linear_sample: bias must have shape \(40,\)"):
        linear_sample(h, w, b[:39], seed=1, streams=torch.arange(4))


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("n, d, v", [(1, 2048, 151936), (37, 4096, 32003), (300, 1024, 50257)])
def test_gpu_logp_is_linear_logprobs_bits_and_rows_are_invariant(dtype, n, d, v, gen):
    h, w, b = _head(n, d, v, dtype, gen, device="cuda")
    streams, positions = _counters(n, gen, device="cuda")
    tok, lp, ent = linear_sample(h, w, b, temperature=0.7, seed=SEED, streams=streams, positions=positions,
                                 return_entropy=True)
    ref_lp, ref_ent = linear_logprob(h, w, tok, b, temperature=0.7, return_entropy=True)
    assert torch.equal(_bits(lp), _bits(ref_lp)) and torch.equal(_bits(ent), _bits(ref_ent))
    for rows in (torch.tensor([n - 1]), torch.randperm(n, generator=gen)):
        rows = rows.cuda()
        t2, lp2 = linear_sample(h[rows], w, b, temperature=0.7, seed=SEED, streams=streams[rows],
                                positions=positions[rows])
        assert torch.equal(t2, tok[rows]) and torch.equal(_bits(lp2), _bits(lp[rows]))
    # The torch backend draws from the same definition: its tokens agree wherever no
    # last-ulp difference of the two backends' log could reorder two keys.
    t_cpu, _ = linear_sample(h.cpu().float(), w.cpu().float(), b.cpu().float(), temperature=0.7, seed=SEED,
                             streams=streams.cpu(), positions=positions.cpu(), backend="torch")
    if dtype == F32:
        assert (t_cpu == tok.cpu()).float().mean() > 0.95


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n, d, v", [(1, 2048, 151936), (16, 1024, 32003)])
def test_gpu_a_seed_tensor_draws_the_int_seeds_bits_eager_and_in_a_graph(dtype, n, d, v, gen):
    h, w, b = _head(n, d, v, dtype, gen, device="cuda")
    streams, positions = _counters(n, gen, device="cuda")
    kw = dict(temperature=0.7, streams=streams, positions=positions, return_entropy=True)
    seeds = (SEED, 0xFFFF_FFFF, (1 << 63) - 1)
    wants = [linear_sample(h, w, b, seed=seed, **kw) for seed in seeds]
    for seed, want in zip(seeds, wants):
        got = linear_sample(h, w, b, seed=torch.tensor(seed, device="cuda"), **kw)
        assert all(torch.equal(_bits(x) if x.is_floating_point() else x, _bits(y) if y.is_floating_point() else y)
                   for x, y in zip(got, want)), seed
    # Captured once with a seed tensor, the graph draws with the tensor's value at each replay.
    seed_buffer = torch.tensor(seeds[0], device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_sample(h, w, b, seed=seed_buffer, **kw)
    for seed, want in reversed(list(zip(seeds, wants))):
        seed_buffer.fill_(seed)
        graph.replay()
        assert torch.equal(out[0], want[0]) and torch.equal(_bits(out[1]), _bits(want[1])) \
            and torch.equal(_bits(out[2]), _bits(want[2])), seed
    if n > 1:  # the seeds draw apart, so a replay that kept the captured seed would be seen
        assert len({tuple(want[0].tolist()) for want in wants}) == len(seeds)


@pytest.mark.gpu
def test_gpu_draws_follow_the_fp32_distribution_and_not_the_bf16_rounded_one():
    v, n = 16, 400_000
    k = torch.arange(v, dtype=torch.float64)
    w = torch.stack([8.0 + 0.0625 * k - 0.5 * (k - 8).abs(), 0.03 * (-1.0) ** k], dim=1).float().cuda()
    h = torch.ones(1, 2, device="cuda")
    tok, _ = linear_sample(h.expand(n, 2), w, seed=SEED, streams=torch.arange(n, device="cuda"),
                           positions=torch.full((n,), 9, device="cuda"))
    counts = torch.bincount(tok, minlength=v).double().cpu()
    p = torch.stack([linear_logprob(h, w, torch.tensor([j], device="cuda"))[0] for j in range(v)]).double().exp().cpu()
    rounded = torch.softmax((h.cpu() @ w.cpu().T)[0].bfloat16().double(), 0)

    assert _accepts(counts, p), _chi_square(counts, p)
    assert not _accepts(counts, rounded), _chi_square(counts, rounded)


_REFUSAL_SCRIPT = """
import sys, torch
from rlkernels import linear_sample
case, n = sys.argv[1], int(sys.argv[2])
g = torch.Generator(device="cuda").manual_seed(0)
h = torch.randn(n, 64, device="cuda", generator=g).bfloat16()
w = (torch.randn(1031, 64, device="cuda", generator=g) * 0.75).bfloat16()
streams = torch.arange(n, device="cuda")
positions = torch.arange(n, device="cuda")
if case == "position":
    positions[n // 2] = -1
if case == "position_high":
    positions[n // 2] = 1 << 32
if case in ("nan", "nan_greedy", "stock"):
    h[n - 1, 3] = float("nan")
if case == "stock":
    torch.multinomial(torch.softmax((h @ w.T).float(), -1), 1)
elif case == "graph":  # captured with good positions, replayed with a bad one
    graph = torch.cuda.CUDAGraph()
    linear_sample(h, w, seed=1, streams=streams, positions=positions)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        linear_sample(h, w, seed=1, streams=streams, positions=positions)
    positions[n // 2] = 1 << 40
    graph.replay()
else:
    linear_sample(h, w, seed=1, streams=streams, positions=positions, greedy=case == "nan_greedy")
torch.cuda.synchronize()
print("finished")
"""


@pytest.mark.gpu
def test_gpu_bad_positions_and_nan_rows_are_refused_as_multinomial_refuses():
    """On CUDA a bad row is refused as torch.multinomial refuses one there: a device-side
    assert (no host sync), raised by the next synchronizing call. A CUDA context does not
    survive it, so each case runs in its own process."""
    import subprocess
    import sys

    def run(case, n=37):
        return subprocess.run([sys.executable, "-c", _REFUSAL_SCRIPT, case, str(n)], capture_output=True, text=True,
                              timeout=300)

    fine = run("fine")
    assert fine.returncode == 0 and "finished" in fine.stdout, fine.stderr[-2000:]
    stock = run("stock")  # the control: stock refuses the NaN row the same way
    assert stock.returncode != 0 and "finished" not in stock.stdout
    # (the kernels' flag for each kind of bad row: test_the_kernels_flag_a_call_with_a_refused_row)
    for case, n in (("position", 37), ("nan_greedy", 1), ("graph", 37)):
        out = run(case, n)
        assert out.returncode != 0 and "finished" not in out.stdout, (case, out.stdout, out.stderr[-2000:])
        refused = "rlkernels.linear_sample: a row's logits are not a distribution"
        assert refused in out.stderr, (case, out.stderr[-2000:])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, n, d, v, truncation", [
    (BF16, 1, 2048, 151936, dict(top_p=0.95)), (BF16, 37, 4096, 32003, dict(top_k=5)),
    (BF16, 300, 1024, 50257, dict(top_k=40, top_p=0.8)), (BF16, 64, 2048, 151936, dict(top_p=0.999)),
    (F32, 37, 1024, 32003, dict(top_k=50, top_p=0.9)),
], ids=["bf16-1-top_p", "bf16-37-top_k", "bf16-300-both", "bf16-64-p999", "fp32-37-both"])
def test_gpu_truncated_logp_is_the_thresholded_linear_logprob_and_rows_are_invariant(dtype, n, d, v, truncation,
                                                                                     gen):
    h, w, b = _head(n, d, v, dtype, gen, device="cuda")
    streams, positions = _counters(n, gen, device="cuda")
    kw = dict(temperature=0.7, seed=SEED, return_entropy=True, return_threshold=True, **truncation)
    tok, lp, ent, tau = linear_sample(h, w, b, streams=streams, positions=positions, **kw)
    ref_lp, ref_ent = linear_logprob(h, w, tok, b, temperature=0.7, return_entropy=True, logit_threshold=tau)
    assert torch.equal(_bits(lp), _bits(ref_lp)) and torch.equal(_bits(ent), _bits(ref_ent))
    assert torch.isfinite(lp).all() and torch.isfinite(tau).all()
    for rows in (torch.tensor([n - 1]), torch.randperm(n, generator=gen)):
        rows = rows.cuda()
        got = linear_sample(h[rows], w, b, streams=streams[rows], positions=positions[rows], **kw)
        for x, y in zip(got, (tok, lp, ent, tau)):
            assert torch.equal(x if x.dtype == torch.int64 else _bits(x), y[rows] if y.dtype == torch.int64
                               else _bits(y[rows]))


@pytest.mark.gpu
@pytest.mark.parametrize("top_k, top_p", [(0, 0.95), (50, 0.9), (2000, 0.99)])
@pytest.mark.parametrize("temperature, transform", [(1.0, LogitTransform()), (0.7, LogitTransform(0.5, 30.0))],
                         ids=["plain", "scaled-capped"])
def test_gpu_top_p_kernel_is_the_torch_definition_through_candidates_and_search(top_k, top_p, temperature,
                                                                               transform, gen, monkeypatch):
    from rlkernels.ops.lm_head import truncation as TR
    from rlkernels.ops.lm_head.statistics import TritonHeadStatistics

    raw = randn(24, 151936, generator=gen, scale=6.0, device="cuda")
    raw[:4] *= 0.05  # flat rows: their nucleus is wider than the candidates, so the kernel searches the row
    raw[4] *= 0.4  # a nucleus past the row's 64 largest, within the candidates
    got = TR.threshold_of_logits(raw, temperature, transform, top_k, top_p)
    want = TR.threshold(TritonHeadStatistics.scores(raw, temperature, transform), top_k, top_p)
    # fp64 sums in two orders: equal away from a border within ~1e-15 of p, where no random row sits.
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    monkeypatch.setattr(TR, "TOP_P_CANDIDATES", 4)
    assert torch.equal(TR.threshold_of_logits(raw, temperature, transform, top_k, top_p).view(torch.int32),
                       got.view(torch.int32))
    monkeypatch.setattr(TR, "FIRST_TIER", 4)  # nuclei past the row program's first tier: bisected
    assert torch.equal(TR.threshold_of_logits(raw, temperature, transform, top_k, top_p).view(torch.int32),
                       got.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("truncation", [{}, dict(top_k=40, top_p=0.9)], ids=["full", "truncated"])
def test_gpu_a_soft_capped_draw_is_the_thresholded_linear_logprob_eager_and_in_a_graph(dtype, truncation, gen):
    # Gemma 2's head: its final soft-cap of 30 on logits whose spread reaches past it.
    n, d, v = 37, 2048, 151936
    h, w, b = _head(n, d, v, dtype, gen, device="cuda", logit_std=12.0)
    streams, positions = _counters(n, gen, device="cuda")
    kw = dict(temperature=0.7, streams=streams, positions=positions, return_entropy=True, return_threshold=True,
              logit_softcap=30.0, **truncation)
    tok, lp, ent, tau = want = linear_sample(h, w, b, seed=SEED, **kw)
    ref_lp, ref_ent = linear_logprob(h, w, tok, b, temperature=0.7, return_entropy=True, logit_softcap=30.0,
                                     logit_threshold=tau if truncation else None)
    assert torch.equal(_bits(lp), _bits(ref_lp)) and torch.equal(_bits(ent), _bits(ref_ent))
    rows = torch.tensor([n - 1, 3, 0], device="cuda")
    alone = linear_sample(h[rows], w, b, seed=SEED, **dict(kw, streams=streams[rows], positions=positions[rows]))
    for x, y in zip(alone, want):
        assert torch.equal(x if x.dtype == torch.int64 else _bits(x), y[rows] if y.dtype == torch.int64 else
                           _bits(y[rows]))
    _assert_a_graph_draws_the_same(h, w, b, want, **kw)
    # Within the contract of the float64 capped log-probs (untruncated: a kept set's border is
    # the fp32 scores', which float64 logits can fall either side of), its backward deterministic.
    if not truncation:
        ref64, _ = linear_logprob_ref(h, w, tok, b, temperature=0.7, logit_softcap=30.0)
        assert float((ref_lp.double() - ref64).abs().max()) <= 5e-4
    hh = h.detach().clone().requires_grad_()
    grads = []
    for _ in range(2):
        hh.grad = None
        linear_logprob(hh, w, tok, b, temperature=0.7, logit_softcap=30.0).sum().backward()
        grads.append(hh.grad.clone())
    assert torch.equal(grads[0], grads[1]) and torch.isfinite(grads[0]).all()


@pytest.mark.gpu
def test_gpu_a_truncated_draw_is_the_same_eager_and_in_a_graph(gen):
    n, d, v = 16, 2048, 151936
    h, w, b = _head(n, d, v, BF16, gen, device="cuda")
    streams, positions = _counters(n, gen, device="cuda")
    kw = dict(temperature=0.7, streams=streams, positions=positions, return_entropy=True, return_threshold=True,
              top_k=40, top_p=0.9)
    _assert_a_graph_draws_the_same(h, w, b, linear_sample(h, w, b, seed=SEED, **kw), **kw)


def _assert_a_graph_draws_the_same(h, w, b, want, **kw):
    """``linear_sample(h, w, b, **kw)`` captured with a seed tensor holding SEED and
    replayed gives ``want``, the eager call's outputs with the int seed, bitwise."""
    seed = torch.tensor(SEED, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_sample(h, w, b, seed=seed, **kw)
    graph.replay()
    for x, y in zip(out, want):
        assert torch.equal(x if x.dtype == torch.int64 else _bits(x), y if y.dtype == torch.int64 else _bits(y))
