"""Keys read where they lie (batch rows of a [B, Hkv, S, D] buffer, strides that are no
whole number of token strides, Hugging Face's cache layout), TMA descriptors of head
rows and where TMA pays.
"""
from __future__ import annotations

import functools

import pytest
import torch

from rlkernels.ops import attention as A
from rlkernels.ops.attention import layout, triton_host

from ...conftest import cpu_backend_cases, randn
from ._cases import bits_equal, gpu_qkv, hf_layout, nan_cache, qkv, sizes


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_keys_read_in_place_in_a_batched_layout(backend, dtype, gen, attn):
    """Keys as batch rows of a [B, Hkv, S, D] buffer (transposed, NaN in the free slots, each
    sequence starting anywhere): prefill, decode-like steps (the split-KV path) and the
    gradients are the bits of each sequence alone; the grads' free slots are zeros."""
    hq, hkv, d = sizes(backend)
    lens, starts, slots = [23, 1, 40], [5, 0, 2], 48
    seqs = [qkv(n, hq, hkv, d, dtype, gen) for n in lens]
    alone = [attn.flash_attn_func(q, k, v, backend=backend)[0] for q, k, v in seqs]
    kb = hf_layout([s[1][0] for s in seqs], starts, slots)
    vb = hf_layout([s[2][0] for s in seqs], starts, slots)
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


def check_shared_keys(attn, backend: str, sizes_: tuple[int, int, int], dtype, device, gen, prompt: int,
                      own: list[int], stranger: int, starts: list[int], slots: int) -> None:
    """Samples of one prompt (``prompt`` keys, then ``own[i]`` of their own), each holding its
    copy at slot ``starts[i]``, and a stranger, decode with ``shared_keys`` naming one
    sibling's copy: every sequence's bits are those of its own keys, alone and in the
    batch. Control: a src whose first keys differ changes the Triton result, so the split-KV
    kernel reads there (the torch backend reads each sequence's own keys)."""
    hq, hkv, d = sizes_
    new = functools.partial(randn, dtype=dtype, generator=gen)
    kp, vp = new(prompt, hkv, d), new(prompt, hkv, d)
    rows_k = [torch.cat([kp, new(n, hkv, d)]) for n in own] + [new(stranger, hkv, d)]
    rows_v = [torch.cat([vp, new(n, hkv, d)]) for n in own] + [new(stranger, hkv, d)]
    lens = [prompt + n for n in own] + [stranger]
    nb = len(lens)
    kb, vb = (hf_layout([r.to(device) for r in rows], starts, slots) for rows in (rows_k, rows_v))
    q = new(nb, hq, d).to(device)
    i32 = dict(dtype=torch.int32, device=device)
    bounds = (torch.arange(nb, **i32), torch.ones(nb, **i32), torch.tensor(starts, **i32), torch.tensor(lens, **i32))

    def step(src=None, length=None):
        shared = None if src is None else (torch.tensor(src, **i32), torch.tensor(length, **i32))
        return attn.attention_by_bounds("test", q, kb, vb, *bounds, 1, slots, backend=backend, shared_keys=shared)

    own_keys = step()
    for b in range(nb):
        alone = attn.attention_by_bounds("test", q[b:b + 1], kb[b:b + 1], vb[b:b + 1], torch.zeros(1, **i32),
                                         *(t[b:b + 1] for t in bounds[1:]), 1, slots, backend=backend)
        assert bits_equal(own_keys[b], alone[0]), f"sequence {b} in the batch"
    siblings = list(range(len(own)))
    lengths = [prompt] * len(own) + [0]
    for src in ([1] * len(own), [0] * len(own), siblings[::-1]):
        assert bits_equal(step(src + [nb - 1], lengths), own_keys), f"shared from {src}"
    assert bits_equal(step(list(range(nb)), lens), own_keys), "each its own"
    wrong = step([nb - 1] * nb, lengths)
    if backend == "triton":
        assert not any(bits_equal(wrong[b], own_keys[b]) for b in siblings), "the stranger's keys were not read"
        assert bits_equal(wrong[nb - 1], own_keys[nb - 1])
    else:
        assert bits_equal(wrong, own_keys)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_shared_keys_read_one_copy_of_a_prompt_with_each_sequences_own_bits(backend, dtype, gen, attn):
    """:func:`check_shared_keys` across a split boundary: a prompt of 53 keys, whole blocks
    to 48, splits of 32."""
    check_shared_keys(attn, backend, sizes(backend), dtype, "cpu", gen, 53, [7, 1, 12], 61, [3, 0, 9, 1], 80)


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


def test_head_rows_desc_layouts():
    """Heads side by side are column blocks, token-major head planes are row blocks; what
    TMA can't describe (D != block, misaligned base) gets None, fp32 gets pointer loads."""
    t = torch.zeros(2, 40, 3, 16, dtype=torch.float16)
    desc, head_rows, head_cols = layout.head_rows_desc(t, 16, 16)
    assert (head_rows, head_cols) == (0, 16) and desc.shape == [80, 48] and desc.strides == [48, 1]
    hf = torch.zeros(2, 3, 40, 16, dtype=torch.float16).transpose(1, 2)
    desc, head_rows, head_cols = layout.head_rows_desc(hf, 16, 16)
    assert (head_rows, head_cols) == (40, 0) and desc.shape == [240, 16] and desc.strides == [16, 1]
    assert layout.head_rows_desc(t, 16, 32) is None
    assert layout.head_rows_desc(torch.zeros(2 * 40 * 3 * 16 + 1, dtype=torch.float16)[1:].view(2, 40, 3, 16), 16, 16) is None
    assert triton_host._tma_descs(True, t.float(), t.float(), 16, 16) == triton_host._NO_DESCS


def test_tma_only_where_the_call_is_large():
    """Small calls (host-bound) keep pointer loads; large ones read through TMA."""
    assert not layout.tma_pays(4, 16, 1024, 1024, 128, True)           # forward: 17 GFLOP
    assert not layout.tma_pays(4, 16, 1024, 1024, 128, True, 2.5)      # its backward: 43 GFLOP
    assert layout.tma_pays(16, 16, 1024, 1024, 128, True)              # 69 GFLOP
    assert layout.tma_pays(1, 16, 16384, 16384, 128, True)
    assert not layout.tma_pays(64, 16, 1, 1024, 128, True)             # a decode step


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_shared_keys_read_one_copy_of_a_prompt_with_each_sequences_own_bits(dtype, gen):
    """:func:`check_shared_keys` on the library's chain, Qwen3's heads: a prompt of 1,100
    keys (whole blocks to 1,088, splits of 1,024), samples 7, 1 and 300 keys past it."""
    check_shared_keys(A, "triton", (16, 8, 128), dtype, "cuda", gen, 1100, [7, 1, 300], 900, [40, 0, 333, 2],
                      1800)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_keys_in_place_in_hugging_face_layout(d):
    """Left-padded sequences whose keys sit in a [B, Hkv, S, D] buffer (NaN in the free
    slots), read in place: prefill rows and decode steps (split-KV, several splits) are
    each sequence's rows alone, bit for bit."""
    hq, hkv, dtype = 16, 8, torch.bfloat16
    lens, slots = [3001, 1, 1031], 3072
    seqs = [gpu_qkv(1, n, hq, hkv, d, dtype, seed=n) for n in lens]
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

