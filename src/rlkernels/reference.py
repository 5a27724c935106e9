"""Float64 ground truth for every op (any device; inputs are upcast, never rounded)."""
from __future__ import annotations

import torch


def matmul_ref(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [..., K] @ b [K, N] (+ bias [N]) in float64."""
    out = a.double() @ b.double()
    return out + bias.double() if bias is not None else out


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in float64: x [..., K], weight [N, K]."""
    return matmul_ref(x, weight.t(), bias)


def bmm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, m, k] @ b [B, k, n] or [k, n] in float64."""
    return a.double() @ b.double()


def linear_logprob_ref(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                       bias: torch.Tensor | None = None, *, temperature: float = 1.0,
                       ignore_index: int = -100,
                       logit_threshold: torch.Tensor | None = None, logit_scale: float = 1.0,
                       logit_softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) in float64, each shaped like ``target``; ignored positions give 0.
    ``logit_threshold``: the truncated distribution over each row's logits >= it.
    ``logit_scale`` s, ``logit_softcap`` c: the logits ``c * tanh(x * s / c)`` (c = 0: x * s)."""
    logits = matmul_ref(hidden.reshape(-1, hidden.shape[-1]), weight.t(), bias) * logit_scale
    if logit_softcap:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    logits = logits / temperature
    finite = logits  # p * logits for the entropy: masked logits enter as 0, not -inf (0 * inf)
    if logit_threshold is not None:
        left_out = logits < logit_threshold.reshape(-1, 1).double()
        finite = torch.where(left_out, 0.0, logits)
        logits = torch.where(left_out, -torch.inf, logits)
    logz = torch.logsumexp(logits, dim=-1)
    t = target.reshape(-1)
    valid = t != ignore_index
    picked = logits.gather(1, torch.where(valid, t, 0).long()[:, None])[:, 0]
    logp = torch.where(valid, picked - logz, torch.zeros_like(logz))
    p = torch.softmax(logits, dim=-1)
    entropy = torch.where(valid, logz - (p * finite).sum(-1), torch.zeros_like(logz))
    return logp.reshape(target.shape), entropy.reshape(target.shape)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm (no bias) in float64: weight * (x - mean) / sqrt(var + eps) over the
    last dim; weight of x's last ``weight.dim()`` dims."""
    xd = x.double()
    centred = xd - xd.mean(-1, keepdim=True)
    return weight.double() * centred * torch.rsqrt((centred * centred).mean(-1, keepdim=True) + eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in float64."""
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.double() if weight is not None else y


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x.double(), dim=dim)


def log_softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.log_softmax(x.double(), dim=dim)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                  softmax_scale: float | None = None, window: int = -1,
                  sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64: q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] (GQA:
    query head h uses KV head h // (Hq // Hkv)); causal is bottom-right aligned (query i
    sits at key position Lk - Lq + i); window >= 0: query i sees no key more than
    ``window`` positions before its own; sinks [Hq]: head h's logit joins each row's
    softmax as one more column whose value is dropped; softcap > 0: scores become softcap *
    tanh(score / softcap) before the mask; a row with no visible key gives 0."""
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    s = qd @ kd.transpose(-1, -2) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    lq, lk = q.shape[1], k.shape[1]
    pos = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    keys = torch.arange(lk, device=q.device)[None, :]
    if causal:
        s = s.masked_fill(keys > pos, float("-inf"))
    if window >= 0:
        s = s.masked_fill(keys < pos - window, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[None, :, None, None].expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2)


def moe_experts_ref(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, interleaved: bool = False, limit: float | None = None,
                    alpha: float = 1.0, transposed: bool = False) -> torch.Tensor:
    """sum_r weights[t, r] * (down_e(act(gate_e(x_t), up_e(x_t))) + down_bias_e), e = index[t, r],
    in float64: x [T, H], index / weights [T, k], gate_up [E, 2I, H] and down [E, H, I]
    ([E, H, 2I] and [E, I, H] with ``transposed``), biases [E, 2I] and [E, H] or None. act is
    silu(gate) * up, or with ``limit`` GPT-OSS's (up' + 1) * gate' * sigmoid(alpha * gate'),
    gate' = min(gate, limit), up' = clamp(up, -limit, limit); gate and up are the halves of
    gate_up's output, or its even and odd columns with ``interleaved``."""
    if transposed:
        gate_up, down = gate_up.mT, down.mT
    inter = down.shape[2]
    xd, wd = x.double(), weights.double()
    gu = torch.einsum("th,tkih->tki", xd, gate_up.double()[index])  # [T, k, 2I]
    if gate_up_bias is not None:
        gu = gu + gate_up_bias.double()[index]
    gate, up = (gu[..., 0::2], gu[..., 1::2]) if interleaved else (gu[..., :inter], gu[..., inter:])
    if limit is None:
        h = torch.nn.functional.silu(gate) * up
    else:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        h = (up + 1) * gate * torch.sigmoid(alpha * gate)
    y = torch.einsum("tki,tkhi->tkh", h, down.double()[index])      # [T, k, H]
    if down_bias is not None:
        y = y + down_bias.double()[index]
    return (wd[..., None] * y).sum(1)
