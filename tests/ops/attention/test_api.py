"""flash_attn_func / flash_attn_varlen_func / flash_attn_with_kvcache: one chain per query row.

Every property is bitwise (torch.equal plus a bit-pattern check): a row's output is the
same as a full causal forward, as decode steps over a KV cache whose unused slots hold
NaN, as chunked prefill, alone, inside a padded batch at any position and packed. The
interpreter runs a small chain (block 16, split 32) to stay fast; the torch backend
runs it too, and once at the library's default chain. The same chain is used by every
entry point: the small chain travels as each call's private ``_tuning`` argument
(``_cases.entry_points``). The GPU tests (``pytest -m gpu``) check the same at L = 4096,
and CUDA-graph decode.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rlkernels import contract, reference
from rlkernels.ops import attention as A
from rlkernels.ops.attention.key_blocks import DEFAULT_CHAIN
from rlkernels.ops.attention.launch import DEFAULT_TUNING

from ...conftest import cpu_backend_cases, randn
from ._cases import (against_float64, bits_equal, check_packed_backward, chunked, decode_row, gpu_qkv, nan_cache,
                     packed, qkv, sizes)


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
def test_a_window_is_a_mask_on_the_one_chain(backend, dtype, gen, attn):
    """window_size=(W, 0): rows within the contract of float64 attention that hides keys more
    than W back; each row the same bits in prefill, decode over a NaN-filled cache, chunked
    prefill, as a prefix, as the last queries of a call, packed beside other sequences;
    gradients packed == alone. A window holding every key gives the unwindowed bits."""
    hq, hkv, d = sizes(backend)
    L = 71 if backend == "triton" else 131
    q, k, v = qkv(L, hq, hkv, d, dtype, gen)
    assert bits_equal(attn.flash_attn_func(q, k, v, window_size=(L - 1, 0), backend=backend),
                      attn.flash_attn_func(q, k, v, backend=backend))
    # W = 5 and 20 sit inside a key block of 16 and across one; 40 spans a split of 32.
    for w in ((5, 40) if backend == "triton" else (0, 5, 20, 40)):
        win = dict(window_size=(w, 0))
        full = attn.flash_attn_func(q, k, v, **win, backend=backend)[0]
        contract.check("attention", dtype, full, reference.attention_ref(q, k, v, window=w)[0])
        for p in (0, w, 31, 32, 47, L - 1):
            assert bits_equal(decode_row(attn, q, k, v, p, backend, L + 9, **win), full[p]), f"window {w}, row {p}"
        assert bits_equal(chunked(attn, q, k, v, [7, 32, 1, L], backend, L + 9, **win)[0], full), f"window {w}"
        for n in (1, 33):
            assert bits_equal(attn.flash_attn_func(q[:, :n], k[:, :n], v[:, :n], **win, backend=backend)[0],
                              full[:n]), f"window {w}, prefix {n}"
        assert bits_equal(attn.flash_attn_func(q[:, L - 19:], k, v, **win, backend=backend)[0], full[L - 19:])
        seqs = [tuple(t[0] for t in qkv(n, hq, hkv, d, dtype, gen)) + (randn(n, hq, d, dtype=dtype, generator=gen),)
                for n in (1, 37)]
        seqs.insert(1, (q[0], k[0], v[0], randn(L, hq, d, dtype=dtype, generator=gen)))
        check_packed_backward(attn, seqs, [1, L, 37], dtype, backend, window=w)
    with pytest.raises(ValueError, match="window_size=\\(3, 2\\) bounds keys after the query"):
        attn.flash_attn_func(q, k, v, causal=False, window_size=(3, 2), backend=backend)
    with pytest.raises(ValueError, match="window_size entries must be >= -1"):
        attn.flash_attn_func(q, k, v, window_size=(-2, 0), backend=backend)
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        attn.flash_attn_varlen_func(q[0], k[0], v[0], *[torch.tensor([0, L], dtype=torch.int32)] * 2, L, L,
                                    window_size=(1.5, 0), backend=backend)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_sinks_join_each_rows_normalizer_on_the_one_chain(backend, dtype, gen, attn):
    """sinks [Hq] (GPT-OSS): within the contract of float64 attention with a sink column,
    forward and the gradients of q, k, v and the sinks; each row the same bits in prefill,
    decode over a NaN-filled cache, chunked, as a prefix and packed, with and without a window."""
    hq, hkv, d = sizes(backend)
    L = 71 if backend == "triton" else 131
    q, k, v = qkv(L, hq, hkv, d, dtype, gen)
    sinks = randn(hq, generator=gen, scale=2.0)
    for w in (-1, 20):
        kw = dict(window_size=(w, 0), sinks=sinks, backend=backend)
        do = randn(*q.shape, dtype=dtype, generator=gen)
        full = against_float64(attn, q, k, v, dtype, do, backend, window=w, sinks=sinks)[0]
        call = dict(window_size=(w, 0), sinks=sinks)
        for p in (0, 31, 32, 47, L - 1):
            assert bits_equal(decode_row(attn, q, k, v, p, backend, L + 9, **call), full[p]), f"window {w}, row {p}"
        assert bits_equal(chunked(attn, q, k, v, [7, 32, 1, L], backend, L + 9, **call)[0], full), f"window {w}"
        assert bits_equal(attn.flash_attn_func(q[:, :33], k[:, :33], v[:, :33], **kw)[0], full[:33])
        other = [t[0] for t in qkv(37, hq, hkv, d, dtype, gen)]
        cu = torch.tensor([0, 37, 37 + L], dtype=torch.int32)
        packed_out = attn.flash_attn_varlen_func(*(torch.cat([o, t[0]]) for o, t in zip(other, (q, k, v))), cu, cu,
                                                 L, L, **kw)
        assert bits_equal(packed_out[37:], full), f"window {w}, packed"
    with pytest.raises(ValueError, match=f"sinks must be \\[{hq}\\] \\(one logit per query head\\), got \\(3,\\)"):
        attn.flash_attn_func(q, k, v, sinks=torch.zeros(3), backend=backend)
    with pytest.raises(ValueError, match="sinks has dtype torch.int64"):
        attn.flash_attn_func(q, k, v, sinks=torch.zeros(hq, dtype=torch.int64), backend=backend)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_softcap_caps_the_scores_on_the_one_chain(backend, dtype, gen, attn):
    """softcap (Gemma 2): within the contract of float64 attention over capped scores,
    forward and gradients, alone and with a window and sinks; each row the same bits in
    prefill, decode over a NaN-filled cache, chunked, as a prefix and packed."""
    hq, hkv, d = sizes(backend)
    L = 71 if backend == "triton" else 131
    q, k, v = qkv(L, hq, hkv, d, dtype, gen)
    q = q * 3  # scores of a few units: the cap of 2 bends them
    sinks = randn(hq, generator=gen, scale=2.0)
    plain = attn.flash_attn_func(q, k, v, backend=backend)
    for w, sink in ((-1, None), (20, sinks)):
        call = dict(window_size=(w, 0), sinks=sink, softcap=2.0)
        do = randn(*q.shape, dtype=dtype, generator=gen)
        full = against_float64(attn, q, k, v, dtype, do, backend, window=w, sinks=sink, softcap=2.0)[0]
        assert not torch.allclose(full, plain[0], atol=1e-2)  # the cap changes the result
        for p in (0, 31, 32, 47, L - 1):
            assert bits_equal(decode_row(attn, q, k, v, p, backend, L + 9, **call), full[p]), f"window {w}, row {p}"
        assert bits_equal(chunked(attn, q, k, v, [7, 32, 1, L], backend, L + 9, **call)[0], full), f"window {w}"
        assert bits_equal(attn.flash_attn_func(q[:, :33], k[:, :33], v[:, :33], **call, backend=backend)[0],
                          full[:33])
        other = [t[0] for t in qkv(37, hq, hkv, d, dtype, gen)]
        cu = torch.tensor([0, 37, 37 + L], dtype=torch.int32)
        packed_out = attn.flash_attn_varlen_func(*(torch.cat([o, t[0]]) for o, t in zip(other, (q, k, v))), cu, cu,
                                                 L, L, **call, backend=backend)
        assert bits_equal(packed_out[37:], full), f"window {w}, packed"
    for bad, err in ((-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                     (torch.tensor(2.0), TypeError), (True, TypeError)):
        with pytest.raises(err, match="rlkernels.flash_attn_func: softcap must be"):
            attn.flash_attn_func(q, k, v, softcap=bad, backend=backend)


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
    assert DEFAULT_TUNING.chain == DEFAULT_CHAIN == A.Chain(64, 1024)
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [128, 64, 80, 256])
def test_gpu_prefill_decode_chunked_packed(dtype, d):
    hq, hkv, L = 16, 8, 4096
    q, k, v = gpu_qkv(2, L, hq, hkv, d, dtype)
    full = A.flash_attn_func(q, k, v)
    err = contract.check("attention", dtype, full[:, :1031], reference.attention_ref(q[:, :1031], k[:, :1031], v[:, :1031]))
    print(f"[contract gpu] attention {dtype} d={d}: rel {err:.2e}")
    # alone, padded batch at position 1, packed with other lengths (primes, 1)
    assert bits_equal(A.flash_attn_func(q[1:], k[1:], v[1:])[0], full[1])
    # a prefix whose keys fit one split (the kernel's one-split form) == the long rows
    for n in (1, 1000, 1024):
        assert bits_equal(A.flash_attn_func(q[:1, :n], k[:1, :n], v[:1, :n])[0], full[0, :n]), f"prefix {n}"
    lens = [1, 1031, L, 2053]
    seqs = [tuple(t[0, :n] for t in gpu_qkv(1, n, hq, hkv, d, dtype, seed=n)) for n in lens]
    seqs[2] = (q[0], k[0], v[0])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out = A.flash_attn_varlen_func(*(torch.cat([s[i] for s in seqs]) for i in range(3)), cu, cu, L, L)
    a = int(cu[2])
    assert bits_equal(out[a:a + L], full[0])
    # decode steps over a NaN-filled cache (split-KV path), every 97th position and boundaries
    cap = L + 64
    kc = torch.full((1, cap, hkv, d), float("nan"), dtype=dtype, device="cuda")
    vc = kc.clone()
    positions = sorted(set(range(0, L, 97)) | {0, 63, 64, 1023, 1024, 1025, 2047, 2048, L - 1})
    for p in positions:
        kc[:, :p], vc[:, :p] = k[:1, :p], v[:1, :p]
        kc[:, p:], vc[:, p:] = float("nan"), float("nan")
        row = A.flash_attn_with_kvcache(q[:1, p:p + 1], kc, vc, k[:1, p:p + 1], v[:1, p:p + 1],
                                        torch.tensor([p], dtype=torch.int32, device="cuda"))
        assert bits_equal(row[0, 0], full[0, p]), f"decode row {p}"
    # chunked prefill in chunks of 1, 7, 64, 100
    for chunks in ([1, 7, 64, 100], [100], [64]):
        kc.fill_(float("nan"))
        vc.fill_(float("nan"))
        outs, pos, i = [], 0, 0
        while pos < L:
            n = min(chunks[i % len(chunks)], L - pos)
            outs.append(A.flash_attn_with_kvcache(q[:1, pos:pos + n], kc, vc, k[:1, pos:pos + n], v[:1, pos:pos + n],
                                                  torch.tensor([pos], dtype=torch.int32, device="cuda")))
            pos, i = pos + n, i + 1
        assert bits_equal(torch.cat(outs, 1)[0], full[0]), f"chunks {chunks}"


@pytest.mark.gpu
@pytest.mark.parametrize("w", [100, 1500])
def test_gpu_window_prefill_decode_chunked_packed_backward(w):
    """A window of 100 (inside a split) and 1500 (across splits): within the contract,
    and one chain for every row whatever the call; gradients packed == alone. A window
    holding every key gives the unwindowed bits (the warp-specialized kernel's)."""
    dtype, d, hq, hkv, L = torch.bfloat16, 128, 16, 8, 4096
    q, k, v = gpu_qkv(2, L, hq, hkv, d, dtype)
    win = dict(window_size=(w, 0))
    # The Triton kernel under a window that hides nothing == the warp-specialized kernel (no window).
    triton_kernel = A.AttnTuning(fwd=dataclasses.replace(A.default_fwd_launch(d, L), ws=False))
    assert bits_equal(A.flash_attn_func(q, k, v, window_size=(L, 0), _tuning=triton_kernel), A.flash_attn_func(q, k, v))
    full = A.flash_attn_func(q, k, v, **win)
    n = 2100
    ref = reference.attention_ref(q[:, :n], k[:, :n], v[:, :n], window=w)
    err = contract.check("attention", dtype, full[:, :n], ref)
    print(f"[contract gpu] attention {dtype} window {w}: rel {err:.2e}")
    assert bits_equal(A.flash_attn_func(q[1:], k[1:], v[1:], **win)[0], full[1])
    lens = [1, 1031, L, 2053]
    seqs = [tuple(t[0, :n] for t in gpu_qkv(1, n, hq, hkv, d, dtype, seed=n)) for n in lens]
    seqs[2] = (q[0], k[0], v[0])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out = A.flash_attn_varlen_func(*(torch.cat([s[i] for s in seqs]) for i in range(3)), cu, cu, L, L, **win)
    assert bits_equal(out[int(cu[2]):int(cu[2]) + L], full[0])
    cap = L + 64
    kc = torch.full((1, cap, hkv, d), float("nan"), dtype=dtype, device="cuda")
    vc = kc.clone()
    for p in sorted({0, w - 1, w, w + 1, 1023, 1024, 2047, 2048, 3001, L - 1}):
        kc[:, :p], vc[:, :p] = k[:1, :p], v[:1, :p]
        kc[:, p:], vc[:, p:] = float("nan"), float("nan")
        row = A.flash_attn_with_kvcache(q[:1, p:p + 1], kc, vc, k[:1, p:p + 1], v[:1, p:p + 1],
                                        torch.tensor([p], dtype=torch.int32, device="cuda"), **win)
        assert bits_equal(row[0, 0], full[0, p]), f"decode row {p}"
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    outs, pos, i = [], 0, 0
    while pos < L:
        n = min((1, 7, 64, 100)[i % 4], L - pos)
        outs.append(A.flash_attn_with_kvcache(q[:1, pos:pos + n], kc, vc, k[:1, pos:pos + n], v[:1, pos:pos + n],
                                              torch.tensor([pos], dtype=torch.int32, device="cuda"), **win))
        pos, i = pos + n, i + 1
    assert bits_equal(torch.cat(outs, 1)[0], full[0]), "chunked"
    grads = [tuple(t[0] for t in gpu_qkv(1, n, hq, hkv, d, dtype, seed=7 + n))
             + (torch.randn(n, hq, d, device="cuda").to(dtype),) for n in (1, 1777, 613)]
    check_packed_backward(A, grads, [1, 1777, 613], dtype, "triton", window=w)


def packed_and_decoded_rows_are_full(q, k, v, full, kw) -> None:
    """One CUDA sequence (q, k, v [1, L, H, D]) whose rows are ``full`` [L, Hq, D] under the
    call's keywords ``kw``: the same bits packed between sequences of 1 and 1031 tokens, and
    as a decode step over a NaN-filled cache at the split and window boundaries."""
    _, L, hq, d = q.shape
    hkv, dtype = k.shape[2], q.dtype
    lens = [1, 1031, L]
    seqs = [tuple(t[0, :n] for t in gpu_qkv(1, n, hq, hkv, d, dtype, seed=n)) for n in lens]
    seqs[2] = (q[0], k[0], v[0])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out = A.flash_attn_varlen_func(*(torch.cat([s[i] for s in seqs]) for i in range(3)), cu, cu, L, L, **kw)
    assert bits_equal(out[int(cu[2]):], full)
    kc = torch.full((1, L + 64, hkv, d), float("nan"), dtype=dtype, device="cuda")
    vc = kc.clone()
    for p in (0, 127, 128, 1023, 1024, 2047, L - 1):
        kc[:, :p], vc[:, :p] = k[:1, :p], v[:1, :p]
        kc[:, p:], vc[:, p:] = float("nan"), float("nan")
        row = A.flash_attn_with_kvcache(q[:1, p:p + 1], kc, vc, k[:1, p:p + 1], v[:1, p:p + 1],
                                        torch.tensor([p], dtype=torch.int32, device="cuda"), **kw)
        assert bits_equal(row[0, 0], full[p]), f"decode row {p}"


@pytest.mark.gpu
@pytest.mark.parametrize("w", [-1, 127])
def test_gpu_sinks_prefill_decode_chunked_packed_backward(w):
    """GPT-OSS's attention shape (64 query heads over 8 KV heads of 64, a sink per head,
    every other layer a window of 128): one chain per row whatever the call; forward and
    gradients (the sinks' too) within the contract of float64."""
    dtype, d, hq, hkv, L = torch.bfloat16, 64, 64, 8, 3000
    q, k, v = gpu_qkv(1, L, hq, hkv, d, dtype)
    sinks = torch.randn(hq, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(dtype)
    kw = dict(window_size=(w, 0), sinks=sinks)
    full = A.flash_attn_func(q, k, v, **kw)[0]
    packed_and_decoded_rows_are_full(q, k, v, full, kw)
    n = 700
    against_float64(A, q[:, :n], k[:, :n], v[:, :n], dtype, torch.randn_like(q[:, :n]), window=w, sinks=sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("w,cap", [(-1, 5.0), (127, 50.0)])
def test_gpu_softcap_prefill_decode_chunked_packed_backward(w, cap):
    """Gemma 2's attention shape (8 query heads over 4 KV heads of 256, scores capped,
    every other layer a window): one chain per row whatever the call; forward and
    gradients within the contract of float64 over capped scores."""
    dtype, d, hq, hkv, L = torch.bfloat16, 256, 8, 4, 3000
    q, k, v = gpu_qkv(1, L, hq, hkv, d, dtype)
    q = q * 4  # scores of several units: a cap of 5 bends them
    kw = dict(window_size=(w, 0), softcap=cap)
    full = A.flash_attn_func(q, k, v, **kw)[0]
    assert not bits_equal(full, A.flash_attn_func(q, k, v, window_size=(w, 0))[0])
    packed_and_decoded_rows_are_full(q, k, v, full, kw)
    n = 700
    against_float64(A, q[:, :n], k[:, :n], v[:, :n], dtype, torch.randn_like(q[:, :n]), window=w, softcap=cap)
    grads = [tuple(t[0] for t in gpu_qkv(1, n, hq, hkv, d, dtype, seed=7 + n))
             + (torch.randn(n, hq, d, device="cuda").to(dtype),) for n in (1, 1777, 613)]
    check_packed_backward(A, grads, [1, 1777, 613], dtype, "triton", window=w, softcap=cap)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_capturable():
    hq, hkv, d, cap = 16, 8, 128, 2048
    q, k, v = gpu_qkv(4, 1, hq, hkv, d, torch.bfloat16)
    kc = torch.randn(4, cap, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    seqlens = torch.tensor([5, 100, 1500, 2000], dtype=torch.int32, device="cuda")
    want = A.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        A.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        got = A.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    graph.replay()
    torch.cuda.synchronize()
    assert bits_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlens_kind", ["tensor", "int"])
@pytest.mark.parametrize("cap", [1000, 3000])
def test_gpu_decode_step_graph_replay_equals_eager(seqlens_kind, cap, monkeypatch):
    """One decode step (append k/v, attend) captured in a CUDA graph and replayed on new
    inputs gives the eager step's bits and caches: one split (finished in the split
    kernel) and several (split kernel + combine); cache_seqlens as a device tensor with
    the index checks off as documented (the graph reads it on replay), or as an int."""
    monkeypatch.setenv(A.CHECK_ENV, "0")
    hq, hkv, d, b = 16, 8, 128, 4
    g = torch.Generator(device="cuda").manual_seed(cap)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)
    kc, vc = rnd(b, cap, hkv, d), rnd(b, cap, hkv, d)
    q, kn, vn = rnd(b, 1, hq, d), rnd(b, 1, hkv, d), rnd(b, 1, hkv, d)
    lens = torch.tensor([5, 100, cap // 2, cap - 1], dtype=torch.int32, device="cuda")

    def step():
        sl = lens if seqlens_kind == "tensor" else cap // 2
        return A.flash_attn_with_kvcache(q, kc, vc, kn, vn, sl)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for trial in range(3):
        for t in (q, kn, vn):
            t.copy_(rnd(*t.shape))
        if trial:
            lens.copy_(torch.tensor([trial, 64 * trial, cap - 1 - trial, cap // 3 + trial], dtype=torch.int32))
        kc0, vc0 = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        got, kc1, vc1 = static_out.clone(), kc.clone(), vc.clone()
        kc.copy_(kc0)
        vc.copy_(vc0)
        want = step()
        assert bits_equal(got, want), f"trial {trial}"
        assert bits_equal(kc1, kc) and bits_equal(vc1, vc), f"trial {trial}: caches"

