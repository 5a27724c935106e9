"""Shared pieces of the attention tests: the entry points under a tuning, bitwise
comparison, inputs, decode / chunked / packed calls, and the checks the CPU and GPU
tests both run."""
from __future__ import annotations

import dataclasses
import functools
import types

import torch

from rlkernels import contract, reference
from rlkernels.ops import attention as A
from rlkernels.ops.attention import triton_host

from ...conftest import randn

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


def decode_row(attn, q, k, v, p: int, backend: str, cap: int, **kw) -> torch.Tensor:
    """Query p as a decode step: cache holds keys [0, p) and NaN beyond; key p appended.
    ``kw``: the call's other arguments (window_size, sinks)."""
    kc, vc = nan_cache(1, cap, k.shape[2], k.shape[3], k.dtype)
    kc[:, :p], vc[:, :p] = k[:, :p], v[:, :p]
    seqlens = torch.tensor([p], dtype=torch.int32)
    out = attn.flash_attn_with_kvcache(q[:, p:p + 1], kc, vc, k[:, p:p + 1], v[:, p:p + 1], seqlens, backend=backend,
                                       **kw)
    assert torch.equal(kc[:, p], k[:, p]) and torch.isnan(kc[:, p + 1:]).all()  # appended in place, nothing else
    return out[0, 0]


def chunked(attn, q, k, v, chunks: list[int], backend: str, cap: int, **kw) -> torch.Tensor:
    """Chunked prefill over a NaN-filled cache, chunk sizes cycling through ``chunks``
    (``kw``: the calls' other arguments)."""
    L = q.shape[1]
    kc, vc = nan_cache(1, cap, k.shape[2], k.shape[3], k.dtype)
    outs, pos, i = [], 0, 0
    while pos < L:
        n = min(chunks[i % len(chunks)], L - pos)
        outs.append(attn.flash_attn_with_kvcache(q[:, pos:pos + n], kc, vc, k[:, pos:pos + n], v[:, pos:pos + n],
                                                 torch.tensor([pos], dtype=torch.int32), backend=backend, **kw))
        pos, i = pos + n, i + 1
    return torch.cat(outs, 1)


def packed(attn, seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], backend: str) -> list[torch.Tensor]:
    """Sequences (q [n, Hq, D], k, v [n, Hkv, D]) packed into one varlen call; per-sequence outputs."""
    lens = [s[0].shape[0] for s in seqs]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    out = attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), backend=backend)
    return [out[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]


def hf_layout(rows: list[torch.Tensor], starts: list[int], slots: int) -> torch.Tensor:
    """Sequences' key rows [n, Hkv, D] at slot starts[b] of a NaN-filled [B, Hkv, S, D]
    buffer (Hugging Face's cache layout), returned as the [B, S, Hkv, D] view the op takes."""
    hkv, d = rows[0].shape[1:]
    buf = torch.full((len(rows), hkv, slots, d), float("nan"), dtype=rows[0].dtype, device=rows[0].device)
    for b, (r, s0) in enumerate(zip(rows, starts)):
        buf[b, :, s0:s0 + r.shape[0]] = r.transpose(0, 1)
    return buf.transpose(1, 2)


def check_packed_backward(attn, seqs, lens, dtype, backend, window: int = -1, softcap: float = 0.0):
    """Output and dQ/dK/dV of packed sequences: run to run equal, each sequence's rows
    equal to it alone, the middle sequence's grads within the contract of float64 autograd.
    attn: the entry points (:func:`entry_points`, or ``A``); seqs: per sequence [q, k, v, dout] rows;
    window: the keys a query sees back (window_size=(window, 0)), -1 for all; softcap: the scores' cap."""
    device = seqs[0][0].device

    def grads(q, k, v, do, cu, mx):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        o = attn.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, window_size=(window, 0), softcap=softcap,
                                        backend=backend)
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
    ref = torch.autograd.grad(reference.attention_ref(q, k, v, window=window, softcap=softcap), (q, k, v), do)
    a, n = int(cu[1]), lens[1]
    for t, r in zip(together[1:], ref):
        contract.check("attention_grad", dtype, t[a:a + n], r[0])


def check_padded_batch_grads_equal_bounds(attn, q, k, v, do, backend):
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


def outputs_and_grads(attn, lens, starts, slots, seqs, device, backend):
    """Packed queries over keys in a NaN-padded [B, Hkv, S, D] buffer read in place (the
    left-padded Hugging Face layout), and over contiguous packed keys: outputs and grads."""
    dev = dict(dtype=torch.int32, device=device)
    bufs = [hf_layout([sq[i] for sq in seqs], starts, slots).requires_grad_() for i in (1, 2)]
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


def check_tma_equals_pointers(chain, lens, starts, slots, seqs, device, backend, monkeypatch):
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
    tma_results = outputs_and_grads(entry_points(with_tma), lens, starts, slots, seqs, device, backend)
    assert len(taken) == 6 and all(taken), "the TMA path must be taken (forward, dK/dV and dQ, twice)"
    pointer_results = outputs_and_grads(entry_points(with_pointers), lens, starts, slots, seqs, device, backend)
    names = ["out", "dq", "dk", "dv", "packed out", "packed dq", "packed dk", "packed dv"]
    for name, a, b in zip(names, tma_results, pointer_results):
        assert bits_equal(a, b), name


def gpu_qkv(B, L, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, L, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))



def against_float64(attn, q, k, v, dtype, dout, backend: str | None = None, window: int = -1,
                    sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """flash_attn_func with ``window_size=(window, 0)``, ``sinks`` and ``softcap``: output and
    the gradients of q, k, v (and the sinks) for ``dout`` within the contract of float64
    attention (with a sink column, scores soft-capped); returns the output, detached."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v) + (() if sinks is None else (sinks,))]
    out = attn.flash_attn_func(*leaves[:3], window_size=(window, 0), sinks=None if sinks is None else leaves[3],
                               softcap=softcap, backend=backend)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference.attention_ref(*ref_leaves[:3], window=window, sinks=None if sinks is None else ref_leaves[3],
                                  softcap=softcap)
    contract.check("attention", dtype, out, ref)
    for got, want in zip(grads, torch.autograd.grad(ref, ref_leaves, dout.double())):
        contract.check("attention_grad", dtype, got, want)
    return out.detach()
