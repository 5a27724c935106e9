"""The attention's GPU properties: the chain's bits across prefill, decode, chunked and
packed calls, TMA and warp-specialized reads, key layouts read in place, and CUDA-graph
decode (``pytest -m gpu``). The shared checks live in ``test_attention``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rlkernels import contract, reference
from rlkernels.kernels import attention_ws as W
from rlkernels.ops import attention as A
from rlkernels.ops.attention import layout, ws_host
from rlkernels.runtime.device import capability

from .test_attention import (_check_packed_backward, _check_padded_batch_grads_equal_bounds,
                             _check_tma_equals_pointers, bits_equal)


def _gpu_qkv(B, L, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, L, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [128, 64, 80, 256])
def test_gpu_prefill_decode_chunked_packed(dtype, d):
    hq, hkv, L = 16, 8, 4096
    q, k, v = _gpu_qkv(2, L, hq, hkv, d, dtype)
    full = A.flash_attn_func(q, k, v)
    err = contract.check("attention", dtype, full[:, :1031], reference.attention_ref(q[:, :1031], k[:, :1031], v[:, :1031]))
    print(f"[contract gpu] attention {dtype} d={d}: rel {err:.2e}")
    # alone, padded batch at position 1, packed with other lengths (primes, 1)
    assert bits_equal(A.flash_attn_func(q[1:], k[1:], v[1:])[0], full[1])
    # a prefix whose keys fit one split (the kernel's one-split form) == the long rows
    for n in (1, 1000, 1024):
        assert bits_equal(A.flash_attn_func(q[:1, :n], k[:1, :n], v[:1, :n])[0], full[0, :n]), f"prefix {n}"
    lens = [1, 1031, L, 2053]
    seqs = [tuple(t[0, :n] for t in _gpu_qkv(1, n, hq, hkv, d, dtype, seed=n)) for n in lens]
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
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64),
                                     (torch.bfloat16, 80), (torch.bfloat16, 256)])
def test_gpu_backward_invariant_and_deterministic(dtype, d):
    hq, hkv = 16, 8
    lens = [1, 1031, 2048, 509]
    g = torch.Generator(device="cuda").manual_seed(3)
    seqs = [[torch.randn(n, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv, hq)] for n in lens]
    _check_packed_backward(A, seqs, lens, dtype, None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.bfloat16, 64), (torch.float16, 80)])
def test_gpu_padded_batch_grads_equal_index_tensors(dtype, d):
    g = torch.Generator(device="cuda").manual_seed(5)
    for b, lq, lk in ((3, 1031, 1031), (2, 67, 2053)):
        q, do = (torch.randn(b, lq, 16, d, device="cuda", generator=g).to(dtype) for _ in range(2))
        k, v = (torch.randn(b, lk, 8, d, device="cuda", generator=g).to(dtype) for _ in range(2))
        _check_padded_batch_grads_equal_bounds(A, q, k, v, do, None)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_keys_in_place_in_hugging_face_layout(d):
    """Left-padded sequences whose keys sit in a [B, Hkv, S, D] buffer (NaN in the free
    slots), read in place: prefill rows and decode steps (split-KV, several splits) are
    each sequence's rows alone, bit for bit."""
    hq, hkv, dtype = 16, 8, torch.bfloat16
    lens, slots = [3001, 1, 1031], 3072
    seqs = [_gpu_qkv(1, n, hq, hkv, d, dtype, seed=n) for n in lens]
    alone = [A.flash_attn_func(*s)[0] for s in seqs]
    starts = [slots - n for n in lens]  # left padding
    bufs = []
    for i in (1, 2):
        buf = torch.full((3, hkv, slots, d), float("nan"), dtype=dtype, device="cuda")
        for b, (s, s0) in enumerate(zip(seqs, starts)):
            buf[b, :, s0:] = s[i][0].transpose(0, 1)
        bufs.append(buf.transpose(1, 2))
    dev = dict(dtype=torch.int32, device="cuda")
    ks, kl = torch.tensor(starts, **dev), torch.tensor(lens, **dev)
    q_rows = torch.cat([s[0][0] for s in seqs])
    q_start = torch.tensor([0, lens[0], lens[0] + lens[1]], **dev)
    out = A.attention_by_bounds("test", q_rows, *bufs, q_start, kl, ks, kl, max(lens), slots)
    for b, n in enumerate(lens):
        a = int(q_start[b])
        assert bits_equal(out[a:a + n], alone[b]), f"prefill of sequence {b}"
    for p in (0, 1023, 1024, 1030):  # decode steps: the sequence cut at p + 1 keys
        n = [min(p + 1, x) for x in lens]
        last = torch.cat([s[0][0, m - 1:m] for s, m in zip(seqs, n)])
        step = A.attention_by_bounds("test", last, *bufs, torch.arange(3, **dev), torch.ones(3, **dev), ks,
                                     torch.tensor(n, **dev), 1, slots)
        for b in range(3):
            assert bits_equal(step[b], alone[b][n[b] - 1]), f"decode step {p} of sequence {b}"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_tma_reads_give_the_pointer_loads_bits(d, monkeypatch):
    """On the GPU: TMA-read K/V, q and dO blocks give the pointer loads' bits (outputs and
    grads; keys in a left-padded NaN-filled buffer read in place, and packed)."""
    hq, hkv = 16, 8
    lens, slots = [1031, 1, 2048, 509], 2100
    g = torch.Generator(device="cuda").manual_seed(7)
    seqs = [[torch.randn(n, h, d, device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv, hq)]
            for n in lens]
    _check_tma_equals_pointers(A.DEFAULT_CHAIN, lens, [slots - n for n in lens], slots, seqs, "cuda", None,
                               monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_warp_specialized_forward_gives_the_triton_kernels_bits(d, monkeypatch):
    """The warp-specialized Hopper forward == the Triton full kernel, output and LSE bit for
    bit, at both head dims it takes (two consumer warpgroups at 128, three at 64): odd
    lengths (1, primes, past a split: partial first-row tiles), Lq < Lk and Lq > Lk, causal
    and not, fp16, keys in Hugging Face's head planes and queries strided inside a fused
    QKV tensor; sequences by their bounds, packed and in a NaN-filled cache (left and right
    padding), also with the persistent kernel on 5 programs."""
    if capability(torch.device("cuda")) != (9, 0) or W.attn_fwd_ws_kernel is None:
        pytest.skip("the warp-specialized forward is for sm_90 with Gluon")
    # Every call takes it, however small (tma_min_flops 0); the reference is the Triton kernel's.
    with_ws = A.AttnTuning(tma_min_flops=0)

    def triton_only(max_q: int) -> A.AttnTuning:
        return A.AttnTuning(fwd=dataclasses.replace(A.default_fwd_launch(d, max_q), ws=False), tma_min_flops=0)

    launched = []

    def recording(launch):
        def launch_and_record(*args, **kwargs):
            launched.append(args[0])
            return launch(*args, **kwargs)
        return launch_and_record

    monkeypatch.setattr(ws_host, "_launch_fwd_ws", {c: recording(f) for c, f in ws_host._launch_fwd_ws.items()})
    g = torch.Generator(device="cuda").manual_seed(11)
    hq, hkv = 16, 8
    cases = [(2, 1031, 1031, True, torch.bfloat16, "plain"), (3, 1, 1, True, torch.bfloat16, "plain"),
             (1, 4099, 4099, True, torch.bfloat16, "plain"), (2, 131, 2053, True, torch.float16, "plain"),
             (1, 2053, 131, False, torch.bfloat16, "plain"), (2, 509, 509, False, torch.float16, "plain"),
             (2, 1031, 1031, True, torch.bfloat16, "hf"), (2, 1031, 1031, True, torch.bfloat16, "fused")]
    for b, lq, lk, causal, dtype, form in cases:
        if form == "fused":  # q, k, v columns of one [B, L, (Hq + 2 Hkv) * D] projection
            qkv_t = torch.randn(b, lq, (hq + 2 * hkv) * d, device="cuda", generator=g).to(dtype)
            q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv_t.split([hq * d, hkv * d, hkv * d], -1))
        else:
            q = torch.randn(b, lq, hq, d, device="cuda", generator=g).to(dtype)
            k, v = (torch.randn(b, lk, hkv, d, device="cuda", generator=g).to(dtype) for _ in range(2))
            if form == "hf":  # [B, Hkv, S, D] read in place
                k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
        n = len(launched)
        ws = A.flash_attn_func(q, k, v, causal=causal, _tuning=with_ws)
        assert len(launched) == n + 1, f"the warp-specialized kernel must run: {(b, lq, lk, form)}"
        ref = A.flash_attn_func(q, k, v, causal=causal, _tuning=triton_only(lq))
        assert len(launched) == n + 1
        assert bits_equal(ws, ref), (b, lq, lk, causal, dtype, form)
        lse_ws = A.triton_fwd(layout.packed(q), k, v, None, None, None, None, lq, lk, causal, d ** -0.5,
                              with_ws, False, dense=(lq, lk))[1]
        lse_ref = A.triton_fwd(layout.packed(q), k, v, None, None, None, None, lq, lk, causal, d ** -0.5,
                               triton_only(lq), False, dense=(lq, lk))[1]
        assert bits_equal(lse_ws, lse_ref), ("lse", b, lq, lk, causal, dtype, form)
    # sequences by their bounds: packed (the next sequence's keys follow), and in a NaN-filled
    # [B, Hkv, S, D] cache read in place, left- and right-padded (the last value block of a
    # right-padded sequence runs into free slots: it must read zeros, not NaN)
    lens, slots = [1, 1031, 4099, 509, 2053], 4200
    seqs = [[torch.randn(n, h, d, device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv)]
            for n in lens]
    dev = dict(dtype=torch.int32, device="cuda")
    q_rows = torch.cat([sq[0] for sq in seqs])
    q_start = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()[:-1], **dev)
    kl = torch.tensor(lens, **dev)
    packed_kv = [torch.cat([sq[i] for sq in seqs]) for i in (1, 2)]
    starts = [(slots - n) if b % 2 == 0 else 0 for b, n in enumerate(lens)]
    bufs = []
    for i in (1, 2):
        buf = torch.full((len(lens), hkv, slots, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        for b, (sq, s0) in enumerate(zip(seqs, starts)):
            buf[b, :, s0:s0 + lens[b]] = sq[i].transpose(0, 1)
        bufs.append(buf.transpose(1, 2))
    cases = [(keys, k_start, programs) for keys, k_start in ((packed_kv, q_start), (bufs, torch.tensor(starts, **dev)))
             for programs in (None, 5)]
    for keys, k_start, programs in cases:
        # programs=5: each program takes many tiles of unequal lengths (the empty tiles of the
        # short sequences among them) in snake rounds, the last round short; stage and
        # barrier phases run on from tile to tile.
        n = len(launched)
        ws = A.attention_by_bounds("test", q_rows, *keys, q_start, kl, k_start, kl, max(lens), keys[0].shape[-3],
                                   _tuning=dataclasses.replace(with_ws, ws_programs=programs))
        assert len(launched) == n + 1, "the warp-specialized kernel must run"
        ref = A.attention_by_bounds("test", q_rows, *keys, q_start, kl, k_start, kl, max(lens), keys[0].shape[-3],
                                    _tuning=triton_only(max(lens)))
        assert len(launched) == n + 1
        assert not ws.isnan().any() and bits_equal(ws, ref), programs
    n = len(launched)
    q, k, v = _gpu_qkv(2, 1031, hq, hkv, 80, torch.bfloat16)
    A.flash_attn_func(q, k, v, _tuning=with_ws)
    assert len(launched) == n, "head_dim 80 stays on the Triton kernel"
    monkeypatch.setenv("RLKERNELS_ATTN_WS", "0")
    q, k, v = _gpu_qkv(2, 1031, hq, hkv, d, torch.bfloat16)
    A.flash_attn_func(q, k, v, _tuning=with_ws)
    assert len(launched) == n, "RLKERNELS_ATTN_WS=0 keeps the Triton kernel"


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_capturable():
    hq, hkv, d, cap = 16, 8, 128, 2048
    q, k, v = _gpu_qkv(4, 1, hq, hkv, d, torch.bfloat16)
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

