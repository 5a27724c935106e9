"""The torch backend: the chain from elementwise ops and ``gemm.chain``'s ascending chains,
sequence by sequence, on any device and in fp64 too. Its bits differ from the Triton
kernels' (separately rounded steps, elementwise dots); it keeps the same contract."""
from __future__ import annotations

import torch

from ...gemm.chain import accumulator_dtype, chain_matmul, chain_sum
from .key_blocks import Chain
from .layout import key_rows
from .sinks import sink_grad


def _empty_state(h: int, rows: int, d: int, adt: torch.dtype, device: torch.device):
    return (torch.full((h, rows), float("-inf"), dtype=adt, device=device),
            torch.zeros((h, rows), dtype=adt, device=device),
            torch.zeros((h, rows, d), dtype=adt, device=device))


def _merge(m1, l1, acc1, m2, l2, acc2):
    m = torch.maximum(m1, m2)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    a1 = torch.exp(m1 - m_safe)
    a2 = torch.exp(m2 - m_safe)
    return m, l1 * a1 + l2 * a2, acc1 * a1[..., None] + acc2 * a2[..., None]


def visible(keys: torch.Tensor, pos: torch.Tensor, causal: bool, window: int) -> torch.Tensor | None:
    """[rows, keys] bool: which keys each query position sees (causal: at or before it;
    window >= 0: no more than ``window`` positions back), or None where every key is seen."""
    seen = None
    if causal:
        seen = keys[None, :] <= pos[:, None]
    if window >= 0:
        near = keys[None, :] >= pos[:, None] - window
        seen = near if seen is None else seen & near
    return seen


def capped(s: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scores, tanh) of scaled scores s: softcap * tanh(s / softcap), Gemma 2's order, and
    the tanh the backward's slope 1 - tanh^2 reads; s itself and None when softcap is 0."""
    if softcap <= 0:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def _torch_seq_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   chain: Chain, window: int, sinks: torch.Tensor | None, softcap: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q [Lq, Hq, D], k/v [Lk, Hkv, D] -> (out [Lq, Hq, D] fp32/fp64, lse [Hq, Lq]).
    ``window`` >= 0: each query sees keys no more than that many positions back; the key
    blocks no query sees are left out (for every row an exact no-op of the chain).
    ``sinks`` [Hq] or None: each head's sink logit, merged into its rows' state last as
    the state (sink, 1, 0). ``softcap`` > 0: the scaled scores are :func:`capped` first.

    Natural-log units here (the Triton kernels use exp2 with log2(e) folded into the
    scale): on the CPU, torch.exp gives every element the same bits whether it lands in
    a vectorised body or a scalar tail, while torch.exp2 does not (measured, torch 2.13).
    """
    adt = accumulator_dtype(q.dtype)
    lq, hq, d = q.shape
    lk, hkv = k.shape[:2]
    g = hq // hkv
    qh = q.permute(1, 0, 2)
    kh = k.permute(1, 0, 2).repeat_interleave(g, 0)
    vh = v.permute(1, 0, 2).repeat_interleave(g, 0)
    pos = torch.arange(lq, device=q.device) + (lk - lq)
    m, l, acc = _empty_state(hq, lq, d, adt, q.device)
    n_end = lk  # causal or not, the last row sees every key
    n_lo = max(lk - lq - window, 0) // chain.block_n * chain.block_n if window >= 0 else 0
    for s0 in range(n_lo // chain.split * chain.split, max(n_end, 0), chain.split):
        m_s, l_s, acc_s = _empty_state(hq, lq, d, adt, q.device)
        for n0 in range(max(s0, n_lo), min(s0 + chain.split, n_end), chain.block_n):
            n1 = min(n0 + chain.block_n, lk)
            # Keys past the sequence would add exact zeros to both chains: leaving them out is the same.
            s, _ = capped(chain_matmul(qh, kh[:, n0:n1].transpose(1, 2)) * scale, softcap)
            seen = visible(torch.arange(n0, n1, device=q.device), pos, causal, window)
            if seen is not None:
                s = torch.where(seen, s, torch.full_like(s, float("-inf")))
            m_new = torch.maximum(m_s, torch.amax(s, -1))
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m_s - m_safe)
            p = torch.exp(s - m_safe[..., None]).to(q.dtype)
            l_s = l_s * alpha + chain_sum(p, -1)
            acc_s = chain_matmul(p, vh[:, n0:n1], acc=acc_s * alpha[..., None])
            m_s = m_new
        m, l, acc = _merge(m, l, acc, m_s, l_s, acc_s)
    if sinks is not None:
        sink = sinks.to(adt)[:, None].expand(hq, lq)
        m, l, acc = _merge(m, l, acc, sink, torch.ones_like(l), torch.zeros_like(acc))
    seen = l > 0
    l1 = torch.where(seen, l, torch.ones_like(l))
    out = acc / l1[..., None]
    lse = torch.where(seen, m + torch.log(l1), torch.full_like(l, float("-inf")))
    return out.permute(1, 0, 2), lse


def _segments(tq: int, q_start, q_len, k_start, k_len, dense: tuple[int, int] | None
              ) -> list[tuple[int, int, int, int]]:
    """(query row, query count, key row, key count) of every sequence, from either index
    form (as :func:`~.triton_host.triton_fwd` reads them)."""
    if dense is None:
        return list(zip(q_start.tolist(), q_len.tolist(), k_start.tolist(), k_len.tolist()))
    lq, k_add = dense
    nb = tq // lq if tq else 0
    k_lens = k_len.tolist() if k_len is not None else [0] * nb
    return [(b * lq, lq, 0, n + k_add) for b, n in zip(range(nb), k_lens)]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The LSE's dtype for inputs of ``dtype``: fp32, fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Autograd is the op's own Function's: the forward records no graph of its own, also where
# flash_attn_with_kvcache calls it on inputs that require grad.
@torch.no_grad()
def torch_fwd(q, k, v, q_start, q_len, k_start, k_len, causal: bool, scale: float, chain: Chain,
              dense: tuple[int, int] | None = None, window: int = -1, sinks: torch.Tensor | None = None,
              softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward on the torch backend: q [Tq, Hq, D], k/v [NB, S, Hkv, D]; sequence b's
    queries are rows q_start[b] + [0, q_len[b]) and its keys rows k_start[b] + [0, k_len[b])
    of ``key_rows(k, b)``, or the padded batch ``dense`` as in triton_fwd. Returns (out
    [Tq, Hq, D] in q's dtype, lse [Hq, Tq] in :func:`lse_dtype`); rows outside every
    sequence are zeros. ``window`` >= 0: each query sees keys no more than that many
    positions back; ``sinks`` [Hq]: each head's sink logit in its rows' normalizers;
    ``softcap`` > 0: the scores are soft-capped (:func:`capped`)."""
    tq, hq, d = q.shape
    if q.is_meta:  # shapes only: meta tensors hold no index values
        return torch.empty_like(q), q.new_empty((hq, tq), dtype=lse_dtype(q.dtype))
    out = torch.zeros((tq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=accumulator_dtype(q.dtype), device=q.device)
    for b, (qs, ql, ks, kl) in enumerate(_segments(tq, q_start, q_len, k_start, k_len, dense)):
        if ql == 0:
            continue
        kb, vb = key_rows(k, b), key_rows(v, b)
        o, ls = _torch_seq_fwd(q[qs:qs + ql], kb[ks:ks + kl], vb[ks:ks + kl], causal, scale, chain, window, sinks,
                               softcap)
        out[qs:qs + ql] = o.to(q.dtype)
        lse[:, qs:qs + ql] = ls
    return out, lse.float() if q.dtype != torch.float64 else lse


def torch_bwd(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, causal: bool, scale: float,
              dense: tuple[int, int] | None = None, window: int = -1, sinks: torch.Tensor | None = None,
              softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dsinks) on the torch backend, the Triton kernels' chain orders with
    elementwise steps; shapes and index forms as :func:`torch_fwd` (dsinks [Hq] in the
    LSE's dtype, None without sinks)."""
    if q.is_meta:
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                None if sinks is None else q.new_empty(sinks.shape, dtype=lse.dtype))
    adt = accumulator_dtype(q.dtype)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    # rowsum(dO * O) per row, kept for the sinks' gradient only
    delta_all = torch.zeros(lse.shape, dtype=lse.dtype, device=q.device) if sinks is not None else None
    hq, hkv = q.shape[1], k.shape[2]
    g = hq // hkv
    for b, (qs, ql, ks, kl) in enumerate(_segments(q.shape[0], q_start, q_len, k_start, k_len, dense)):
        if ql == 0 or kl == 0:
            continue
        kb, vb, dkb, dvb = key_rows(k, b), key_rows(v, b), key_rows(dk, b), key_rows(dv, b)
        qh = q[qs:qs + ql].permute(1, 0, 2)           # [Hq, Lq, D]
        doh = do[qs:qs + ql].permute(1, 0, 2)
        oh = out[qs:qs + ql].permute(1, 0, 2)
        kh = kb[ks:ks + kl].permute(1, 0, 2).repeat_interleave(g, 0)
        vh = vb[ks:ks + kl].permute(1, 0, 2).repeat_interleave(g, 0)
        ls = lse[:, qs:qs + ql].to(adt)
        ls = torch.where(ls == float("-inf"), torch.full_like(ls, float("inf")), ls)
        delta = chain_sum(doh.to(adt) * oh.to(adt), -1)
        if delta_all is not None:
            delta_all[:, qs:qs + ql] = delta.to(lse.dtype)
        s, t = capped(chain_matmul(qh, kh.transpose(1, 2)) * scale, softcap)
        p = torch.exp(s - ls[..., None])
        seen = visible(torch.arange(kl, device=q.device), torch.arange(ql, device=q.device) + (kl - ql), causal,
                       window)
        if seen is not None:
            p = torch.where(seen, p, torch.zeros_like(p))
        dp = chain_matmul(doh, vh.transpose(1, 2))
        ds = p * (dp - delta[..., None])
        if t is not None:  # the cap's slope
            ds = ds * (1 - t * t)
        ds = ds.to(q.dtype)
        p = p.to(q.dtype)
        # dK/dV: one chain per key over (head of the group, query) in that order.
        pg = p.reshape(hkv, g * ql, kl)  # head h = kv_head * g + j: rows ordered (j, query)
        dsg = ds.reshape(hkv, g * ql, kl)
        dv_h = chain_matmul(pg.transpose(1, 2), doh.reshape(hkv, g * ql, -1))
        dk_h = chain_matmul(dsg.transpose(1, 2), qh.reshape(hkv, g * ql, -1)) * scale
        dvb[ks:ks + kl] = dv_h.to(v.dtype).permute(1, 0, 2)
        dkb[ks:ks + kl] = dk_h.to(k.dtype).permute(1, 0, 2)
        dq[qs:qs + ql] = (chain_matmul(ds, kh) * scale).to(q.dtype).permute(1, 0, 2)
    return dq, dk, dv, None if sinks is None else sink_grad(sinks.to(lse.dtype), lse, delta_all, torch.exp)
