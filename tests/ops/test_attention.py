"""flash_attn_func / flash_attn_varlen_func / flash_attn_with_kvcache: one chain per query row.

Every property is bitwise (torch.equal plus a bit-pattern check): a row's output is the
same as a full causal forward, as decode steps over a KV cache whose unused slots hold
NaN, as chunked prefill, alone, inside a padded batch at any position and packed. The
interpreter runs a small chain (block 16, split 32) to stay fast; the torch backend
runs it too, and once at the library's default chain. The same chain is used by every
entry point: the small chain travels as each call's private ``_tuning`` argument
(:func:`entry_points`).
"""
from __future__ import annotations

import dataclasses
import functools
import types

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager

from rlkernels import contract, reference, testing
from rlkernels.kernels import attention_ws as W
from rlkernels.kernels._triton import GluonTensorDescriptor
from rlkernels.ops import attention as A
from rlkernels.ops.attention import triton_host
from rlkernels.registry import get_op, registered_ops

from ..conftest import cpu_backend_cases, interpreter_only, randn

SMALL_CHAIN = (16, 32)
ENTRY_POINTS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "attention_by_bounds")


def entry_points(tuning: A.AttnTuning) -> types.SimpleNamespace:
    """The public entry points, each call under ``tuning`` (their private ``_tuning``
    keyword). The module ``A`` itself is the same namespace under the library's defaults."""
    return types.SimpleNamespace(**{name: functools.partial(getattr(A, name), _tuning=tuning)
                                    for name in ENTRY_POINTS})


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same values and the same bit patterns (signed zeros, NaN payloads)."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
        return False
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


def sizes(backend: str) -> tuple[int, int, int]:
    """(Hq, Hkv, D): GQA everywhere; the interpreter gets the smallest."""
    return (2, 1, 16) if backend == "triton" else (4, 2, 16)


def qkv(L: int, hq: int, hkv: int, d: int, dtype, gen, batch: int = 1):
    q = randn(batch, L, hq, d, dtype=dtype, generator=gen)
    k = randn(batch, L, hkv, d, dtype=dtype, generator=gen)
    v = randn(batch, L, hkv, d, dtype=dtype, generator=gen)
    return q, k, v


def nan_cache(batch: int, cap: int, hkv: int, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((batch, cap, hkv, d), float("nan"), dtype=dtype),
            torch.full((batch, cap, hkv, d), float("nan"), dtype=dtype))


def decode_row(attn, q, k, v, p: int, backend: str, cap: int) -> torch.Tensor:
    """Query p as a decode step: cache holds keys [0, p) and NaN beyond; key p appended."""
    kc, vc = nan_cache(1, cap, k.shape[2], k.shape[3], k.dtype)
    kc[:, :p], vc[:, :p] = k[:, :p], v[:, :p]
    seqlens = torch.tensor([p], dtype=torch.int32)
    out = attn.flash_attn_with_kvcache(q[:, p:p + 1], kc, vc, k[:, p:p + 1], v[:, p:p + 1], seqlens, backend=backend)
    assert torch.equal(kc[:, p], k[:, p]) and torch.isnan(kc[:, p + 1:]).all()  # appended in place, nothing else
    return out[0, 0]


def chunked(attn, q, k, v, chunks: list[int], backend: str, cap: int) -> torch.Tensor:
    """Chunked prefill over a NaN-filled cache, chunk sizes cycling through ``chunks``."""
    L = q.shape[1]
    kc, vc = nan_cache(1, cap, k.shape[2], k.shape[3], k.dtype)
    outs, pos, i = [], 0, 0
    while pos < L:
        n = min(chunks[i % len(chunks)], L - pos)
        outs.append(attn.flash_attn_with_kvcache(q[:, pos:pos + n], kc, vc, k[:, pos:pos + n], v[:, pos:pos + n],
                                                 torch.tensor([pos], dtype=torch.int32), backend=backend))
        pos, i = pos + n, i + 1
    return torch.cat(outs, 1)


def packed(attn, seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], backend: str) -> list[torch.Tensor]:
    """Sequences (q [n, Hq, D], k, v [n, Hkv, D]) packed into one varlen call; per-sequence outputs."""
    lens = [s[0].shape[0] for s in seqs]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    out = attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), backend=backend)
    return [out[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]


@pytest.fixture
def attn() -> types.SimpleNamespace:
    """The entry points on the small chain (the interpreter's speed)."""
    return entry_points(A.AttnTuning(A.Chain(*SMALL_CHAIN)))


# ---------------------------------------------------------------- forward invariance


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases())
def test_prefill_rows_equal_every_other_way(backend, dtype, gen, attn):
    """Full causal rows == alone == in a padded batch at any position == right-padded ==
    packed == decode steps == chunked prefill; lengths 1, primes, several splits."""
    hq, hkv, d = sizes(backend)
    L = 71 if backend == "triton" else 131  # > 2 splits of 32 (4 of 32 on the torch side)
    q, k, v = qkv(L, hq, hkv, d, dtype, gen)
    full = attn.flash_attn_func(q, k, v, backend=backend)[0]
    assert full.dtype == dtype and torch.isfinite(full).all()
    # Inside a batch with other sequences, at position 0 and 2; a right-padded copy.
    other = qkv(L, hq, hkv, d, dtype, gen, batch=2)
    for at in (0, 2):
        parts = [list(t.unbind(0)) for t in other]
        for p, t in zip(parts, (q, k, v)):
            p.insert(at, t[0])
        batch = attn.flash_attn_func(*(torch.stack(p) for p in parts), backend=backend)
        assert bits_equal(batch[at], full)
    pad = 5
    padded = [torch.cat([t, randn(1, pad, *t.shape[2:], dtype=dtype, generator=gen)], 1) for t in (q, k, v)]
    assert bits_equal(attn.flash_attn_func(*padded, backend=backend)[0, :L], full)
    # Prefixes are sequences too: rows of a shorter sequence == the first rows of the long one.
    for n in (1, 17, 32, 33, 53):
        assert bits_equal(attn.flash_attn_func(q[:, :n], k[:, :n], v[:, :n], backend=backend)[0], full[:n])
    # Packed with sequences of length 1, a prime and more splits.
    seqs = [tuple(t[0] for t in qkv(n, hq, hkv, d, dtype, gen)) for n in (1, 37)]
    seqs.insert(1, (q[0], k[0], v[0]))
    outs = packed(attn, seqs, backend)
    assert bits_equal(outs[1], full)
    for i in (0, 2):
        assert bits_equal(outs[i], attn.flash_attn_func(*(t[None] for t in seqs[i]), backend=backend)[0])
    # Decode steps at split and block boundaries, the first and the last position.
    cap = L + 9
    for p in (0, 1, 15, 16, 31, 32, 33, 64, L - 1):
        assert bits_equal(decode_row(attn, q, k, v, p, backend, cap), full[p]), f"decode row {p}"
    # Chunked prefill (chunk sizes scaled to the chain: 1, 7, 2 blocks, 3 blocks + 4).
    for chunks in ([1, 7, 32, 52], [7], [32, 1]):
        if backend == "triton" and chunks == [7]:
            continue  # the interpreter is slow; [1, 7, 32, 52] covers 7
        assert bits_equal(chunked(attn, q, k, v, chunks, backend, cap)[0], full), f"chunks {chunks}"


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_decode_batch_of_ragged_caches(backend, dtype, gen, attn):
    """One decode step for a batch of caches of different lengths (NaN past each) == each
    sequence's prefill row; the batch's lengths and positions change nothing."""
    hq, hkv, d = sizes(backend)
    lens = [1, 33, 64, 47]
    cap = 80
    seqs = [qkv(n, hq, hkv, d, dtype, gen) for n in lens]
    kc, vc = nan_cache(len(lens), cap, hkv, d, dtype)
    for i, (q, k, v) in enumerate(seqs):
        kc[i, :lens[i] - 1], vc[i, :lens[i] - 1] = k[0, :-1], v[0, :-1]
    qs = torch.cat([s[0][:, -1:] for s in seqs])
    kn = torch.cat([s[1][:, -1:] for s in seqs])
    vn = torch.cat([s[2][:, -1:] for s in seqs])
    out = attn.flash_attn_with_kvcache(qs, kc, vc, kn, vn, torch.tensor([n - 1 for n in lens], dtype=torch.int32),
                                       backend=backend)
    for i, (q, k, v) in enumerate(seqs):
        assert bits_equal(out[i, 0], attn.flash_attn_func(q, k, v, backend=backend)[0, -1]), f"sequence {i}"


def test_default_chain_torch_backend(gen):
    """The library's chain (block 64, split 1024) on the torch backend: rows past the first
    split boundary equal decode steps and a packed batch."""
    assert A.DEFAULT_TUNING.chain == A.DEFAULT_CHAIN == A.Chain(64, 1024)
    L, hq, hkv, d = 1100, 2, 1, 8
    q, k, v = qkv(L, hq, hkv, d, torch.float32, gen)
    full = A.flash_attn_func(q, k, v, backend="torch")[0]
    for p in (0, 63, 64, 1023, 1024, 1099):
        assert bits_equal(decode_row(A, q, k, v, p, "torch", L + 3), full[p]), f"decode row {p}"
    outs = packed(A, [tuple(t[0, :n] for t in qkv(n, hq, hkv, d, torch.float32, gen)) for n in (5,)]
                  + [(q[0], k[0], v[0])], "torch")
    assert bits_equal(outs[1], full)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_tile_rows_past_their_keys(backend, dtype, gen, attn):
    """Rows of one query tile whose later key blocks (and splits) are fully masked give the
    rows' own bits: bottom-right causal chunks put a tile's rows at unaligned positions."""
    hq, hkv, d = sizes(backend)
    L = 50
    q, k, v = qkv(L, hq, hkv, d, dtype, gen)
    full = attn.flash_attn_func(q, k, v, backend=backend)[0]
    # Lq != Lk: queries are the last rows, positions L - Lq + i (not block aligned).
    for lq in (1, 3, 19, 30):
        out = attn.flash_attn_func(q[:, L - lq:], k, v, backend=backend)[0]
        assert bits_equal(out, full[L - lq:]), f"Lq = {lq}"


def test_stock_sdpa_is_not_invariant(gen):
    """Stock SDPA on the CPU: a decode row (one query over the keys so far) differs from
    the same row of the full causal forward, so the properties above are not vacuous."""
    L, h, d = 77, 4, 64
    q, k, v = (randn(1, h, L, d, generator=gen) for _ in range(3))
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    differ = sum(not torch.equal(torch.nn.functional.scaled_dot_product_attention(
        q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1]), full[:, :, p:p + 1]) for p in range(L))
    assert differ > L // 2


def test_nan_in_unused_cache_slots_does_not_leak(gen, attn):
    hq, hkv, d = sizes("torch")
    q, k, v = qkv(20, hq, hkv, d, torch.float32, gen)
    kc, vc = nan_cache(1, 64, hkv, d, torch.float32)
    kc[:, :20], vc[:, :20] = k, v
    out = attn.flash_attn_with_kvcache(q[:, -1:], kc, vc, cache_seqlens=torch.tensor([20], dtype=torch.int32),
                                       backend="torch")
    assert torch.isfinite(out).all()
    assert bits_equal(out[:, 0], attn.flash_attn_func(q, k, v, backend="torch")[:, -1])


def _hf_layout(rows: list[torch.Tensor], starts: list[int], slots: int) -> torch.Tensor:
    """Sequences' key rows [n, Hkv, D] at slot starts[b] of a NaN-filled [B, Hkv, S, D]
    buffer (Hugging Face's cache layout), returned as the [B, S, Hkv, D] view the op takes."""
    hkv, d = rows[0].shape[1:]
    buf = torch.full((len(rows), hkv, slots, d), float("nan"), dtype=rows[0].dtype, device=rows[0].device)
    for b, (r, s0) in enumerate(zip(rows, starts)):
        buf[b, :, s0:s0 + r.shape[0]] = r.transpose(0, 1)
    return buf.transpose(1, 2)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_keys_read_in_place_in_a_batched_layout(backend, dtype, gen, attn):
    """Keys as batch rows of a [B, Hkv, S, D] buffer (transposed, NaN in the free slots, each
    sequence starting anywhere): prefill, decode-like steps (the split-KV path) and the
    gradients are the bits of each sequence alone; the grads' free slots are zeros."""
    hq, hkv, d = sizes(backend)
    lens, starts, slots = [23, 1, 40], [5, 0, 2], 48
    seqs = [qkv(n, hq, hkv, d, dtype, gen) for n in lens]
    alone = [attn.flash_attn_func(q, k, v, backend=backend)[0] for q, k, v in seqs]
    kb = _hf_layout([s[1][0] for s in seqs], starts, slots)
    vb = _hf_layout([s[2][0] for s in seqs], starts, slots)
    assert kb.stride(1) == d and kb.stride(2) == slots * d  # token-major per head, as Hugging Face keeps it
    ks, kl = torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    # Prefill: queries packed as rows, keys in place.
    q_rows = torch.cat([s[0][0] for s in seqs])
    q_start = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()[:-1], dtype=torch.int32)
    q_rows.requires_grad_()
    kg, vg = kb.detach().clone().requires_grad_(), vb.detach().clone().requires_grad_()
    out = attn.attention_by_bounds("test", q_rows, kg, vg, q_start, kl, ks, kl, max(lens), slots, backend=backend)
    for b, n in enumerate(lens):
        assert bits_equal(out[int(q_start[b]):int(q_start[b]) + n], alone[b]), f"prefill of sequence {b}"
    # Decode-like: each sequence's last query alone over its keys in place.
    last = torch.cat([s[0][0, -1:] for s in seqs])
    step = attn.attention_by_bounds("test", last, kb, vb, torch.arange(3, dtype=torch.int32),
                                    torch.ones(3, dtype=torch.int32), ks, kl, 1, slots, backend=backend)
    for b in range(3):
        assert bits_equal(step[b], alone[b][-1]), f"decode step of sequence {b}"
    # Gradients: the same bits as each sequence's own backward, zeros in the free slots.
    do = randn(*out.shape, dtype=dtype, generator=gen)
    dq, dk, dv = torch.autograd.grad(out, (q_rows, kg, vg), do)
    assert dk.shape == kb.shape and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    for b, ((q, k, v), n, s0) in enumerate(zip(seqs, lens, starts)):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        a = int(q_start[b])
        ref = torch.autograd.grad(attn.flash_attn_func(q, k, v, backend=backend), (q, k, v), do[a:a + n][None])
        assert bits_equal(dq[a:a + n], ref[0][0]) and bits_equal(dk[b, s0:s0 + n], ref[1][0])
        assert bits_equal(dv[b, s0:s0 + n], ref[2][0])
        free = torch.ones(slots, dtype=torch.bool)
        free[s0:s0 + n] = False
        assert (dk[b, free] == 0).all() and (dv[b, free] == 0).all()


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_keys_whose_batch_rows_are_not_whole_token_strides_apart(backend, dtype, gen, attn):
    """Keys whose batch stride is no whole number of token strides, and k and v in
    different layouts: read from copies, the same bits and gradients as contiguous keys."""
    hq, hkv, d = sizes(backend)
    b, n = 2, 37
    q, k, v = qkv(n, hq, hkv, d, dtype, gen, batch=b)
    flat = torch.full((b * (n * hkv * d + 1),), float("nan"), dtype=dtype)
    odd = flat.as_strided((b, n, hkv, d), (n * hkv * d + 1, hkv * d, d, 1))  # batch stride: one element more
    odd.copy_(k)
    v_hf = v.transpose(1, 2).contiguous().transpose(1, 2)  # v in [B, Hkv, S, D] memory, k not
    rows = torch.arange(b * n, dtype=torch.int32)
    starts, lens = torch.zeros(b, dtype=torch.int32), torch.full((b,), n, dtype=torch.int32)

    def run(kk, vv):
        qq = q.reshape(b * n, hq, d).clone().requires_grad_()
        kk, vv = kk.detach().requires_grad_(), vv.detach().requires_grad_()
        out = attn.attention_by_bounds("test", qq, kk, vv, rows[::n].contiguous(), lens, starts, lens, n, n,
                                       backend=backend)
        do = torch.ones_like(out)
        return (out, *torch.autograd.grad(out, (qq, kk, vv), do))
    want = run(k, v)
    for got_t, want_t, name in zip(run(odd, v_hf), want, ("out", "dq", "dk", "dv")):
        assert bits_equal(got_t.contiguous(), want_t.contiguous()), name


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_kvcache_in_hugging_face_layout(backend, dtype, gen, attn):
    """flash_attn_with_kvcache over caches given as [B, Hkv, S, D].transpose(1, 2): the
    append lands in the caller's buffer and the rows are the contiguous cache's bits."""
    hq, hkv, d = sizes(backend)
    lens, cap = [9, 33], 40
    seqs = [qkv(n, hq, hkv, d, dtype, gen) for n in lens]
    kc, vc = nan_cache(2, cap, hkv, d, dtype)
    kt = torch.full((2, hkv, cap, d), float("nan"), dtype=dtype).transpose(1, 2)
    vt = torch.full((2, hkv, cap, d), float("nan"), dtype=dtype).transpose(1, 2)
    for b, (q, k, v) in enumerate(seqs):
        for c, src in ((kc, k), (vc, v), (kt, k), (vt, v)):
            c[b, :lens[b] - 1] = src[0, :-1]
    seqlens = torch.tensor([n - 1 for n in lens], dtype=torch.int32)
    args = [torch.cat([s[i][:, -1:] for s in seqs]) for i in range(3)]
    want = attn.flash_attn_with_kvcache(args[0], kc, vc, args[1], args[2], seqlens, backend=backend)
    got = attn.flash_attn_with_kvcache(args[0], kt, vt, args[1], args[2], seqlens, backend=backend)
    assert bits_equal(got, want) and torch.equal(kt[:, :max(lens)].isnan(), kc[:, :max(lens)].isnan())
    for b, n in enumerate(lens):
        assert bits_equal(kt[b, n - 1], seqs[b][1][0, -1]) and bits_equal(got[b, 0], attn.flash_attn_func(
            *seqs[b], backend=backend)[0, -1])


# ---------------------------------------------------------------- accuracy


def _tol(dtype):
    return contract.tolerance("attention", dtype).tolerance


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16, torch.bfloat16,
                                                              torch.float64)))
@pytest.mark.parametrize("causal", [True, False])
def test_accuracy_vs_float64(backend, dtype, causal, gen, attn):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("float64 runs on the torch backend")
    hq, hkv, d = (4, 2, 24) if backend == "torch" else (2, 1, 24)  # 24: a head_dim padded to 32 in the kernel
    for lq, lk in ((45, 45), (9, 45)):
        q = randn(2, lq, hq, d, dtype=dtype, generator=gen)
        k = randn(2, lk, hkv, d, dtype=dtype, generator=gen)
        v = randn(2, lk, hkv, d, dtype=dtype, generator=gen)
        out = attn.flash_attn_func(q, k, v, causal, 0.3, backend=backend)
        err = contract.check("attention", dtype, out, reference.attention_ref(q, k, v, causal, 0.3))
        print(f"[contract] attention {backend} {dtype} causal={causal} {lq}x{lk}: rel {err:.2e}")


def _check_packed_backward(attn, seqs, lens, dtype, backend):
    """Output and dQ/dK/dV of packed sequences: run to run equal, each sequence's rows
    equal to it alone, the middle sequence's grads within the contract of float64 autograd.
    attn: the entry points (:func:`entry_points`, or ``A``); seqs: per sequence [q, k, v, dout] rows."""
    device = seqs[0][0].device

    def grads(q, k, v, do, cu, mx):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        o = attn.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, backend=backend)
        return (o,) + torch.autograd.grad(o, (q, k, v), do)

    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cat = [torch.cat([s[i] for s in seqs]) for i in range(4)]
    together = grads(*cat, cu, max(lens))
    assert all(bits_equal(a, b) for a, b in zip(together, grads(*cat, cu, max(lens))))
    for i, n in enumerate(lens):
        a = int(cu[i])
        alone = grads(*seqs[i], torch.tensor([0, n], dtype=torch.int32, device=device), n)
        for name, t, u in zip(("out", "dq", "dk", "dv"), together, alone):
            assert bits_equal(t[a:a + n], u), f"{name} of sequence {i}"
    q, k, v, do = (t[None].double().requires_grad_() if j < 3 else t[None].double() for j, t in enumerate(seqs[1]))
    ref = torch.autograd.grad(reference.attention_ref(q, k, v), (q, k, v), do)
    a, n = int(cu[1]), lens[1]
    for t, r in zip(together[1:], ref):
        contract.check("attention_grad", dtype, t[a:a + n], r[0])


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_backward_accuracy_and_invariance(backend, dtype, gen, attn):
    """dQ/dK/dV vs float64 autograd; a sequence's grads alone == inside a packed batch;
    run to run equal."""
    hq, hkv, d = sizes(backend)
    lens = [1, 37, 29] if backend == "triton" else [1, 70, 41]

    seqs = [[randn(n, h, d, dtype=dtype, generator=gen) for h in (hq, hkv, hkv, hq)] for n in lens]
    _check_packed_backward(attn, seqs, lens, dtype, backend)


def _check_padded_batch_grads_equal_bounds(attn, q, k, v, do, backend):
    """flash_attn_func on a padded batch (the kernels' dense form: no index tensors) ==
    the same sequences through index tensors (attention_by_bounds), out and dQ/dK/dV bit
    for bit; Lq <= Lk is bottom-right causal, keys of sequence b in batch row b."""
    b, lq, hq, d = q.shape
    lk = k.shape[1]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn.flash_attn_func(*leaves, backend=backend)
    dense = [out, *torch.autograd.grad(out, leaves, do)]
    dev = dict(dtype=torch.int32, device=q.device)
    leaves = [q.reshape(b * lq, hq, d).clone().requires_grad_(), k.clone().requires_grad_(),
              v.clone().requires_grad_()]
    out = attn.attention_by_bounds("test", *leaves, torch.arange(b, **dev) * lq, torch.full((b,), lq, **dev),
                                   torch.zeros(b, **dev), torch.full((b,), lk, **dev), lq, lk, backend=backend)
    grads = torch.autograd.grad(out, leaves, do.reshape(b * lq, hq, d))
    bounds = [out.view(b, lq, hq, d), grads[0].view(b, lq, hq, d), grads[1], grads[2]]
    for name, x, y in zip(("out", "dq", "dk", "dv"), dense, bounds):
        assert bits_equal(x, y), name


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_padded_batch_grads_equal_index_tensors(backend, dtype, gen, attn):
    """The two index forms (a padded batch's dense form, index tensors) give one result."""
    hq, hkv, d = sizes(backend)
    for b, lq, lk in ((3, 37, 37), (2, 5, 40), (1, 1, 1)):
        q = randn(b, lq, hq, d, dtype=dtype, generator=gen)
        k, v = (randn(b, lk, hkv, d, dtype=dtype, generator=gen) for _ in range(2))
        _check_padded_batch_grads_equal_bounds(attn, q, k, v, randn(b, lq, hq, d, dtype=dtype, generator=gen),
                                               backend)


def test_gradcheck_float64_torch_backend(gen, attn):
    q = randn(1, 20, 2, 8, dtype=torch.float64, generator=gen).requires_grad_()
    k = randn(1, 20, 1, 8, dtype=torch.float64, generator=gen).requires_grad_()
    v = randn(1, 20, 1, 8, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: attn.flash_attn_func(a, b, c, backend="torch"), (q, k, v))


# ---------------------------------------------------------------- TMA and pointer loads


def _outputs_and_grads(attn, lens, starts, slots, seqs, device, backend):
    """Packed queries over keys in a NaN-padded [B, Hkv, S, D] buffer read in place (the
    left-padded Hugging Face layout), and over contiguous packed keys: outputs and grads."""
    dev = dict(dtype=torch.int32, device=device)
    bufs = [_hf_layout([sq[i] for sq in seqs], starts, slots).requires_grad_() for i in (1, 2)]
    q = torch.cat([sq[0] for sq in seqs]).requires_grad_()
    do = torch.cat([sq[3] for sq in seqs])
    q_start = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()[:-1], **dev)
    kl = torch.tensor(lens, **dev)
    out = attn.attention_by_bounds("test", q, *bufs, q_start, kl, torch.tensor(starts, **dev), kl, max(lens), slots,
                                   backend=backend)
    results = [out, *torch.autograd.grad(out, (q, *bufs), do)]
    k, v = (torch.cat([sq[i] for sq in seqs]).requires_grad_() for i in (1, 2))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), **dev)
    packed_out = attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), backend=backend)
    return results + [packed_out, *torch.autograd.grad(packed_out, (q, k, v), do)]


def _check_tma_equals_pointers(chain, lens, starts, slots, seqs, device, backend, monkeypatch):
    """With ``chain``: every call reading through TMA (tma_min_flops 0, however small) ==
    pointer loads, the Triton kernels' (the warp-specialized forward has its own test)."""
    d = seqs[0][1].shape[-1]
    fwd = dataclasses.replace(A.default_fwd_launch(d, max(lens)), ws=False)
    with_tma = A.AttnTuning(chain, fwd=fwd, tma_min_flops=0)
    with_pointers = A.AttnTuning(chain, fwd=dataclasses.replace(fwd, tma=False),
                                 bwd=dataclasses.replace(A.default_bwd_launch(d), tma=False), tma_min_flops=0)
    taken = []
    descs = triton_host._tma_descs

    def recording_descs(*args):
        found = descs(*args)
        taken.append(found[-1])
        return found

    monkeypatch.setattr(triton_host, "_tma_descs", recording_descs)
    tma_results = _outputs_and_grads(entry_points(with_tma), lens, starts, slots, seqs, device, backend)
    assert len(taken) == 6 and all(taken), "the TMA path must be taken (forward, dK/dV and dQ, twice)"
    pointer_results = _outputs_and_grads(entry_points(with_pointers), lens, starts, slots, seqs, device, backend)
    names = ["out", "dq", "dk", "dv", "packed out", "packed dq", "packed dk", "packed dv"]
    for name, a, b in zip(names, tma_results, pointer_results):
        assert bits_equal(a, b), name


def test_head_rows_desc_layouts():
    """Heads side by side are column blocks, token-major head planes are row blocks; what
    TMA can't describe (D != block, misaligned base) gets None, fp32 gets pointer loads."""
    t = torch.zeros(2, 40, 3, 16, dtype=torch.float16)
    desc, head_rows, head_cols = A.head_rows_desc(t, 16, 16)
    assert (head_rows, head_cols) == (0, 16) and desc.shape == [80, 48] and desc.strides == [48, 1]
    hf = torch.zeros(2, 3, 40, 16, dtype=torch.float16).transpose(1, 2)
    desc, head_rows, head_cols = A.head_rows_desc(hf, 16, 16)
    assert (head_rows, head_cols) == (40, 0) and desc.shape == [240, 16] and desc.strides == [16, 1]
    assert A.head_rows_desc(t, 16, 32) is None
    assert A.head_rows_desc(torch.zeros(2 * 40 * 3 * 16 + 1, dtype=torch.float16)[1:].view(2, 40, 3, 16), 16, 16) is None
    assert triton_host._tma_descs(True, t.float(), t.float(), 16, 16) == triton_host._NO_DESCS


def test_ws_descriptor_layouts():
    """The warp-specialized kernel's TMA views: q/out rows [T, H * D]; keys with heads side
    by side (1, 0, D) or in Hugging Face's head planes read in place (H, 1, 0), a batch
    row's slots per plane, one packed run of rows (XB = 0); None where TMA can't."""
    if GluonTensorDescriptor is None:
        pytest.skip("Triton without Gluon")
    rows = torch.zeros(80, 3, 16, dtype=torch.float16)
    desc = A.ws_rows_desc(rows)
    assert desc.shape == [80, 48] and desc.strides == [48, 1] and desc.block_shape == [64, 16]
    fused = torch.zeros(80, 5, 16, dtype=torch.bfloat16)[:, 1:4]  # a slice of a fused projection
    desc = A.ws_rows_desc(fused)
    assert desc.shape == [80, 48] and desc.strides == [80, 1] and desc.base.data_ptr() == fused.data_ptr()
    assert A.ws_rows_desc(torch.zeros(3, 80, 16, dtype=torch.float16).transpose(0, 1)) is None  # head planes
    t = torch.zeros(2, 40, 3, 16, dtype=torch.float16)
    desc, xb, xh, xc = A.ws_keys_desc(t)
    assert (xb, xh, xc) == (1, 0, 16) and desc.shape == [2, 40, 48] and desc.strides == [1920, 48, 1]
    hf = torch.zeros(2, 3, 40, 16, dtype=torch.bfloat16).transpose(1, 2)
    desc, xb, xh, xc = A.ws_keys_desc(hf)
    assert (xb, xh, xc) == (3, 1, 0) and desc.shape == [6, 40, 16] and desc.strides == [640, 16, 1]
    desc, xb, xh, xc = A.ws_keys_desc(t[:1])  # packed sequences in one batch row
    assert (xb, xh, xc) == (0, 0, 16) and desc.shape == [1, 40, 48]
    misaligned = torch.zeros(2 * 40 * 3 * 16 + 1, dtype=torch.float16)[1:].view(2, 40, 3, 16)
    assert A.ws_keys_desc(misaligned) is None and A.ws_rows_desc(misaligned[0]) is None
    odd_rows = torch.zeros(2, 40, 3, 20, dtype=torch.float16)[..., :16]  # token stride 60: not 16-byte aligned
    assert A.ws_keys_desc(odd_rows) is None
    assert A.ws_keys_desc(torch.zeros(1, 40, 3, 16, dtype=torch.float16).expand(2, 40, 3, 16)) is None  # stride 0
    out = torch.zeros(80, 3, 16, dtype=torch.float16)
    assert not A.ws_fwd(rows, t, t, out, torch.zeros(3, 80), (None,) * 4, 2, 40, 40, (40, 40), True, 1.0,
                        A.DEFAULT_TUNING)  # CPU: not launched


def test_ws_register_split_fits_the_register_file():
    """Each consumer count the warp-specialized forward launches with fits the SM's register
    file at launch ((consumers + 1) warpgroups at launch_registers) and after setmaxnreg
    (the producer's warpgroup at PRODUCER_REGS, each consumer at consumer_registers), in
    setmaxnreg's steps of 8, and setmaxnreg only raises the consumers' count."""
    for consumers in sorted(set(A.WS_CONSUMERS.values())):
        launch, consumer = W.launch_registers(consumers), W.consumer_registers(consumers)
        assert launch % 8 == 0 and consumer % 8 == 0, consumers
        assert (consumers + 1) * 128 * launch <= W.REGISTER_FILE, consumers
        assert consumers * 128 * consumer + 128 * W.PRODUCER_REGS <= W.REGISTER_FILE, consumers
        assert W.PRODUCER_REGS <= launch <= consumer, consumers


def test_tma_only_where_the_call_is_large():
    """Small calls (host-bound) keep pointer loads; large ones read through TMA."""
    assert not A.tma_pays(4, 16, 1024, 1024, 128, True)           # forward: 17 GFLOP
    assert not A.tma_pays(4, 16, 1024, 1024, 128, True, 2.5)      # its backward: 43 GFLOP
    assert A.tma_pays(16, 16, 1024, 1024, 128, True)              # 69 GFLOP
    assert A.tma_pays(1, 16, 16384, 16384, 128, True)
    assert not A.tma_pays(64, 16, 1, 1024, 128, True)             # a decode step


@interpreter_only
def test_tma_reads_give_the_pointer_loads_bits(gen, monkeypatch):
    """Outputs and dQ/dK/dV with K/V (forward, dQ) and q/dO (dK/dV) blocks read through TMA
    descriptors == with pointer loads, bit for bit: keys in place in a NaN-padded
    [B, Hkv, S, D] buffer and packed; lengths 1, a prime, several splits."""
    hq, hkv, d = sizes("triton")
    lens, starts, slots = [37, 1, 70], [5, 0, 2], 80
    seqs = [[randn(n, h, d, dtype=torch.float16, generator=gen) for h in (hq, hkv, hkv, hq)] for n in lens]
    _check_tma_equals_pointers(A.Chain(*SMALL_CHAIN), lens, starts, slots, seqs, "cpu", "triton", monkeypatch)


# ---------------------------------------------------------------- errors, registry, custom op


def test_bad_inputs_are_refused():
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 3, 16)
    with pytest.raises(ValueError, match=r"rlkernels.flash_attn_func: query heads \(4\) must be a multiple of KV heads \(3\)"):
        A.flash_attn_func(q, k, k)
    with pytest.raises(ValueError, match="rlkernels.flash_attn_func: unsupported head_dim 300"):
        A.flash_attn_func(torch.randn(1, 2, 2, 300), torch.randn(1, 2, 2, 300), torch.randn(1, 2, 2, 300))
    with pytest.raises(ValueError, match="rlkernels.flash_attn_func: tensors must share one dtype"):
        A.flash_attn_func(q, q.half(), q)
    with pytest.raises(ValueError, match="rlkernels.flash_attn_func: q must have 4 dims"):
        A.flash_attn_func(q[0], q, q)
    for bad in (0.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="rlkernels.flash_attn_func: softmax_scale must be positive and finite"):
            A.flash_attn_func(q, q, q, softmax_scale=bad)
    t = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="rlkernels.flash_attn_varlen_func: cu_seqlens_q must be int32, got torch.int64"):
        A.flash_attn_varlen_func(t, t, t, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing, got cu_seqlens_k.1. = 7 > cu_seqlens_k.2. = 5"):
        A.flash_attn_varlen_func(t, t, t, cu, torch.tensor([0, 7, 5], dtype=torch.int32), 6, 7)
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the total length 10, got 9"):
        A.flash_attn_varlen_func(t, t, t, torch.tensor([0, 4, 9], dtype=torch.int32), cu, 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0, got 1"):
        A.flash_attn_varlen_func(t, t, t, torch.tensor([1, 4, 10], dtype=torch.int32), cu, 6, 6)
    with pytest.raises(ValueError, match="a sequence of 6 tokens exceeds max_seqlen_q = 5"):
        A.flash_attn_varlen_func(t, t, t, cu, cu, 5, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must have shape \[3\]"):
        A.flash_attn_varlen_func(t, t, t, cu, cu[:2], 6, 6)
    kc = torch.zeros(2, 16, 2, 16)
    qd = torch.randn(2, 1, 2, 16)
    kn = torch.randn(2, 1, 2, 16)
    with pytest.raises(ValueError, match=r"rlkernels.flash_attn_with_kvcache: cache_seqlens\[1\] = 16 with 1 new tokens is beyond the cache of 16"):
        A.flash_attn_with_kvcache(qd, kc, kc.clone(), kn, kn, torch.tensor([3, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        A.flash_attn_with_kvcache(qd, kc, kc.clone(), kn, kn, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="pass both k and v"):
        A.flash_attn_with_kvcache(qd, kc, kc.clone(), kn, None, 3)
    with pytest.raises(ValueError, match="must have a unit last stride"):
        odd = torch.zeros(2, 16, 16, 2).transpose(2, 3)  # [2, 16, 2, 16], last stride 2
        A.flash_attn_with_kvcache(qd, odd, odd, cache_seqlens=3)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_empty_batch_gives_empty_results(backend, dtype):
    # B = 0 is a batch like any other: the empty result, as every op gives for no rows.
    hq, hkv, d = sizes(backend)
    cu = torch.tensor([0], dtype=torch.int32)
    q = torch.zeros(0, hq, d, dtype=dtype, requires_grad=True)
    k = torch.zeros(0, hkv, d, dtype=dtype, requires_grad=True)
    out = A.flash_attn_varlen_func(q, k, k, cu, cu, 0, 0, backend=backend)
    assert out.shape == (0, hq, d) and out.dtype == dtype
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    q4, k4 = torch.zeros(0, 3, hq, d, dtype=dtype), torch.zeros(0, 5, hkv, d, dtype=dtype)
    out = A.flash_attn_func(q4, k4, k4, backend=backend)
    assert out.shape == (0, 3, hq, d) and out.dtype == dtype
    kc, vc = torch.zeros(0, 8, hkv, d, dtype=dtype), torch.zeros(0, 8, hkv, d, dtype=dtype)
    kn = torch.zeros(0, 1, hkv, d, dtype=dtype)
    for seqlens in (torch.zeros(0, dtype=torch.int32), 2):
        out = A.flash_attn_with_kvcache(q4[:, :1], kc, vc, kn, kn.clone(), seqlens, backend=backend)
        assert out.shape == (0, 1, hq, d) and out.dtype == dtype
    # Sequences with no query rows (Lq = 0): the empty result too, with and without gradients.
    q0 = torch.zeros(2, 0, hq, d, dtype=dtype, requires_grad=True)
    k0 = torch.randn(2, 5, hkv, d).to(dtype).requires_grad_()
    out = A.flash_attn_func(q0, k0, k0, backend=backend)
    assert out.shape == (2, 0, hq, d)
    out.sum().backward()
    assert q0.grad.shape == q0.shape and torch.equal(k0.grad, torch.zeros_like(k0))
    for seqlens in (torch.tensor([1, 3], dtype=torch.int32), 2, None):
        out = A.flash_attn_with_kvcache(q0.detach(), k0.detach(), k0.detach(), cache_seqlens=seqlens, backend=backend)
        assert out.shape == (2, 0, hq, d) and out.dtype == dtype


def test_negative_cache_seqlens_is_named_as_such():
    kc, qd = torch.zeros(2, 16, 2, 16), torch.randn(2, 1, 2, 16)
    with pytest.raises(ValueError, match=r"rlkernels\.flash_attn_with_kvcache: cache_seqlens must be >= 0, "
                                         r"got cache_seqlens\[1\] = -1$"):
        A.flash_attn_with_kvcache(qd, kc, kc.clone(), cache_seqlens=torch.tensor([3, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"rlkernels\.flash_attn_with_kvcache: cache_seqlens must be >= 0, got -2$"):
        A.flash_attn_with_kvcache(qd, kc, kc.clone(), cache_seqlens=-2)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
@pytest.mark.parametrize("seqlens", ["tensor", "int"])
def test_append_refuses_caches_whose_slots_share_memory(backend, dtype, seqlens, gen):
    # Appending into an expanded cache would write every row's new key into one slot (row 0
    # then reads row 1's key); k_cache and v_cache in one memory would swap keys for values.
    hq, hkv, d = sizes(backend)
    b, cap = 2, 8
    q = randn(b, 1, hq, d, dtype=dtype, generator=gen)
    kn, vn = randn(b, 1, hkv, d, dtype=dtype, generator=gen), randn(b, 1, hkv, d, dtype=dtype, generator=gen)
    cs = torch.tensor([3, 3], dtype=torch.int32) if seqlens == "tensor" else 3
    base_k = randn(1, cap, hkv, d, dtype=dtype, generator=gen)
    base_v = randn(1, cap, hkv, d, dtype=dtype, generator=gen)
    kc, vc = base_k.expand(b, cap, hkv, d), base_v.expand(b, cap, hkv, d)
    before = base_k.clone()
    with pytest.raises(ValueError, match=r"rlkernels\.flash_attn_with_kvcache: k_cache is written in place but "
                                         r"its dim 0 \(size 2\) has stride 0 \(strides \(0, "):
        A.flash_attn_with_kvcache(q, kc, vc, kn, vn, cs, backend=backend)
    with pytest.raises(ValueError, match=r"v_cache is written in place but its dim 0 \(size 2\) has stride 0"):
        A.flash_attn_with_kvcache(q, kc.contiguous(), vc, kn, vn, cs, backend=backend)
    assert torch.equal(base_k, before)  # refused before any write
    shared = kc.contiguous()
    with pytest.raises(ValueError, match=r"k_cache and v_cache share memory"):
        A.flash_attn_with_kvcache(q, shared, shared, kn, vn, cs, backend=backend)
    flat = torch.zeros(b * cap * hkv * d + hkv * d, dtype=dtype)
    shifted = [flat[o:o + b * cap * hkv * d].view(b, cap, hkv, d) for o in (0, hkv * d)]  # one slot apart
    with pytest.raises(ValueError, match=r"k_cache and v_cache share memory"):
        A.flash_attn_with_kvcache(q, *shifted, kn, vn, cs, backend=backend)
    # Read-only use of an expanded cache writes nothing: allowed, and the same bits as a copy.
    read = A.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, backend=backend)
    assert bits_equal(read, A.flash_attn_with_kvcache(q, kc.contiguous(), vc.contiguous(), cache_seqlens=cs,
                                                      backend=backend))
    # k and v interleaved in one buffer ([B, S, 2, Hkv, D]) share storage without sharing a slot.
    stacked = torch.stack([kc, vc], dim=2).contiguous()
    k2, v2 = kc.contiguous(), vc.contiguous()
    got = A.flash_attn_with_kvcache(q, stacked[:, :, 0], stacked[:, :, 1], kn, vn, cs, backend=backend)
    assert bits_equal(got, A.flash_attn_with_kvcache(q, k2, v2, kn, vn, cs, backend=backend))
    assert torch.equal(stacked[:, :, 0], k2) and torch.equal(stacked[:, :, 1], v2)


@pytest.mark.parametrize("forced", [None, "torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_meta_inputs_give_meta_results(forced, dtype, monkeypatch):
    # Shape inference (meta / fake tensors) has no values to read back: every entry point
    # gives the output's shape and dtype, whatever backend is asked for.
    if forced:
        monkeypatch.setenv("RLKERNELS_BACKEND", forced)

    def t(*shape, dt=dtype, grad=False):
        return torch.empty(*shape, device="meta", dtype=dt, requires_grad=grad)

    q, k = t(2, 3, 4, 16, grad=True), t(2, 5, 2, 16, grad=True)
    out = A.flash_attn_func(q, k, k)
    assert out.device.type == "meta" and out.shape == (2, 3, 4, 16) and out.dtype == dtype
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device="meta")
    out = A.flash_attn_varlen_func(t(6, 4, 16), t(6, 2, 16), t(6, 2, 16), cu, cu, 4, 4)
    assert out.device.type == "meta" and out.shape == (6, 4, 16) and out.dtype == dtype
    seqlens = torch.tensor([1, 2], dtype=torch.int32, device="meta")
    for cs in (seqlens, 3):
        out = A.flash_attn_with_kvcache(t(2, 1, 4, 16), t(2, 8, 2, 16), t(2, 8, 2, 16), t(2, 1, 2, 16),
                                        t(2, 1, 2, 16), cs)
        assert out.device.type == "meta" and out.shape == (2, 1, 4, 16) and out.dtype == dtype


def test_triton_refuses_bf16_on_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rlkernels.flash_attn_func: the Triton interpreter's tl.dot is wrong on bfloat16"):
        A.flash_attn_func(x, x, x, backend="triton")
    with pytest.raises(ValueError, match="rlkernels.flash_attn_func: float64 runs on the torch backend only"):
        A.flash_attn_func(x.double(), x.double(), x.double(), backend="triton")


def test_registry_and_custom_op(gen, attn):
    assert registered_ops()["flash_attn"] == ("torch", "triton")
    q, k, v = qkv(9, 2, 1, 8, torch.float32, gen, batch=2)
    op = get_op("flash_attn", "torch")
    assert op.op_class == "attention" and bits_equal(op(q, k, v), A.flash_attn_func(q, k, v, backend="torch"))
    fn, x = A.FlashAttnTorch().invariance_case(torch.device("cpu"), torch.float32, gen)
    testing.assert_batch_invariant(fn, x)
    # The custom op (what torch.compile sees) gives the eager path's bits and gradients.
    qs = q.reshape(-1, *q.shape[2:])
    ks, vs = (t.reshape(1, -1, *t.shape[2:]) for t in (k, v))  # keys [1, Tk, Hkv, D]: one packed run of rows
    ar = torch.arange(2, dtype=torch.int32)
    lens = torch.full((2,), 9, dtype=torch.int32)
    out, lse = torch.ops.rlkernels.flash_attn_fwd(qs, ks, vs, ar * 9, lens, ar * 9, lens, 9, 9, True, 0.35,
                                                  *SMALL_CHAIN, "torch", False)
    assert bits_equal(out.view(2, 9, 2, 8), attn.flash_attn_func(q, k, v, softmax_scale=0.35, backend="torch"))
    torch.library.opcheck(torch.ops.rlkernels.flash_attn_fwd.default,
                          (qs.requires_grad_(), ks, vs, ar * 9, lens, ar * 9, lens, 9, 9, True, 0.35,
                           *SMALL_CHAIN, "torch", False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_every_route_gives_one_result(backend, dtype, gen, attn):
    """Each entry point's bits, gradients and cache writes are the same whichever route the
    call takes: without autograd (the forward core alone), with autograd (the Function) and
    traced by torch.compile (the custom ops, a padded batch's dense form as index tensors)."""
    torch._dynamo.reset()
    hq, hkv, d = sizes(backend)
    b, lq, lk = 2, 21, 37
    q = randn(b, lq, hq, d, dtype=dtype, generator=gen)
    k, v = (randn(b, lk, hkv, d, dtype=dtype, generator=gen) for _ in range(2))
    do = randn(b, lq, hq, d, dtype=dtype, generator=gen)
    traced_ops = set()

    def compiled(fn):
        """fn through torch.compile (AOTAutograd, no codegen), noting the ops of its graphs."""
        def recording(gm, example_inputs):
            traced_ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return aot_eager(gm, example_inputs)
        return torch.compile(fn, backend=recording)

    def with_grads(fn, *inputs, dout):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, dout)]

    def same(fn, *inputs, dout):
        with torch.no_grad():
            plain = fn(*inputs)
        eager = with_grads(fn, *inputs, dout=dout)
        traced_ops.clear()
        traced = with_grads(compiled(fn), *inputs, dout=dout)
        assert "rlkernels.flash_attn_fwd.default" in traced_ops, "the traced route must run"
        assert bits_equal(plain, eager[0])
        for name, x, y in zip(("out", "dq", "dk", "dv"), eager, traced):
            assert bits_equal(x, y), name

    same(lambda q, k, v: attn.flash_attn_func(q, k, v, True, 0.3, backend=backend), q, k, v, dout=do)
    same(lambda q, k, v: attn.flash_attn_func(q, k, v, False, backend=backend), q, k, v, dout=do)
    rows = q.reshape(b * lq, hq, d)
    ar = torch.arange(b, dtype=torch.int32)
    q_len, k_len = torch.full((b,), lq, dtype=torch.int32), torch.full((b,), lk, dtype=torch.int32)
    same(lambda q, k, v: attn.attention_by_bounds("test", q, k, v, ar * lq, q_len, ar * 0, k_len, lq, lk,
                                                  backend=backend), rows, k, v, dout=do.reshape(b * lq, hq, d))
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32) for n in (lq, lk))
    same(lambda q, k, v: attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, lq, lk, backend=backend), rows,
         k.reshape(b * lk, hkv, d), v.reshape(b * lk, hkv, d), dout=do.reshape(b * lq, hq, d))
    # Decode steps appending to NaN-filled caches: one position for all, and one per sequence.
    cap = 48
    kn, vn = (randn(b, 1, hkv, d, dtype=dtype, generator=gen) for _ in range(2))
    for seqlens in (lk, torch.tensor([lk, 5], dtype=torch.int32)):
        traced_ops.clear()
        results = []
        for call in (attn.flash_attn_with_kvcache, compiled(attn.flash_attn_with_kvcache)):
            kc, vc = nan_cache(b, cap, hkv, d, dtype)
            kc[:, :lk], vc[:, :lk] = k, v
            results.append([call(q[:, -1:], kc, vc, kn, vn, seqlens, backend=backend), kc, vc])
        assert {"rlkernels.flash_attn_fwd.default", "rlkernels.flash_attn_kvcache_append.default"} <= traced_ops
        (out, kc, vc), (out_traced, kc_traced, vc_traced) = results
        assert bits_equal(out, out_traced), seqlens
        for name, x, y in (("k_cache", kc, kc_traced), ("v_cache", vc, vc_traced)):  # NaN in the free slots
            assert torch.equal(x.view(torch.int16 if dtype == torch.float16 else torch.int32),
                               y.view(torch.int16 if dtype == torch.float16 else torch.int32)), (name, seqlens)
