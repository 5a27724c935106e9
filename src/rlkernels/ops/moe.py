"""Mixture-of-experts routing and experts whose per-token bits do not depend on the batch.

Where a stock MoE block's bits move with the batch (transformers 5 ``*SparseMoeBlock``):
the router GEMM (split and tiles picked from the token count), each expert's
``F.linear`` over however many tokens were routed to it (or one ``torch._grouped_mm``
over all of them), ``torch.topk``'s order among equal scores, and the combine
``index_add_``: in the model dtype, in the order the experts happen to be visited, with
atomics on CUDA. Here, per token:

* :func:`moe_topk` -- the routing: ``softmax`` of the router logits in fp32
  (:func:`rlkernels.softmax`: a fixed-order row sum), the k largest probabilities by a
  stable descending sort (equal probabilities: the lowest expert id first), and the
  renormalisation ``w_j = p_j / (p_0 + p_1 + ... + p_{k-1})``, the sum in ascending rank
  order. Backward likewise (no reduction whose order follows the batch).
* :func:`moe_experts` -- each selected expert's ``gate_up`` GEMM, ``silu(gate) * up``
  and ``down`` GEMM on the canonical K-chain (one row's bits are those of the row alone,
  whatever number of rows the expert received), then the combine in fp32 in ascending
  rank order, ``((w_0 y_0 + w_1 y_1) + ...) + w_{k-1} y_{k-1}``, rounded once. A token's
  k outputs land in a [T, k, H] buffer at their (token, rank) slots -- each slot written
  once, no reduction, no atomics -- and the sum over k runs as k - 1 elementwise adds.

The backward of :func:`moe_experts` is written out (:class:`_MoeExpertsFunction`): dX of
each expert is a GEMM like the forward; a token's dX is the fp32 sum of its k slots,
ascending rank, rounded once (a gather by the inverse permutation, never
``index_add_``); dW of expert e reduces over its tokens in ascending token order in fp32
(continuing ``main_grad`` where the parameter has one); the routing weights' gradient
``<dOut_t, y_{t,r}>`` is a fixed-order row dot.

Backend: on the Triton backend the forward is two grouped launches over all experts
(``gemm.grouped``: tiles found on the device from the sorted expert ids, no count read on
the host, silu * up fused into the gate/up launch on GPUs), so the forward captures into
a CUDA graph; the backward's data gradients (dh = dY @ down_e, dX = d gate_up @
gate_up_e) are two more grouped launches and each weight gradient one more (every
expert's dW_e, a chain over its tokens ascending, the tiles of all experts in one grid),
so the backward reads no count on the host either. The torch backend runs every GEMM as
one call per expert that received tokens, with the per-expert counts read on the host
(docs/design/moe.md). The bits are the same on either path: a slot's row is the
canonical K-chain of its row alone, an expert's dW the chain over its tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _validate as V
from .activations import sigmoid_chain, silu_chain
from .matmul import gemm_backend_for, linear, main_grad_target
from .reductions import ROW_BLOCK, TorchReductionBackend, TritonReductionBackend, reduction_backend_for
from .softmax import softmax
from .._env import triton_interpret
from ..gemm.chain import accumulator_dtype
from ..gemm.grouped import grouped_config, grouped_gemm, grouped_wgrad
from ..kernels._triton import cdiv, pow2_at_least
from ..kernels.moe import rank_sum_kernel, top_k_route_kernel
from ..runtime.device import can_read_back
from ..runtime.launcher import NO_FP_FUSION, cached_launcher
from ..registry import BackendUnavailableError, OpImpl, register_backends

_REDUCTIONS = {"torch": TorchReductionBackend(), "triton": TritonReductionBackend()}

# A multiply then an add must stay two roundings (the elementwise ops' bits), never one FMA.
_launch_top_k = cached_launcher(top_k_route_kernel, leading_tensors=4, options=NO_FP_FUSION)
_launch_rank_sum = cached_launcher(rank_sum_kernel, leading_tensors=3, options=NO_FP_FUSION)
ROUTE_MAX_EXPERTS = 1024  # one [BLOCK_E] tile of probabilities per token
_ROUND_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}
RANK_SUM_BLOCK_H = 1024


# ---------------------------------------------------------------- routing


class _TopKWeightsFunction(torch.autograd.Function):
    """(w [T, k], index [T, k]): index the k largest probs per row (:func:`top_k_lowest_id`'s
    order), w = probs[t, index[t, j]] (/ their sum over j, ascending j, with ``normalize``).
    ``fused``: one Triton launch (:func:`_top_k_route`), else the sort, gather, adds and
    division as torch ops; the same IEEE operations in the same order, so the same bits.

    Backward: with g the gradient wrt w, dp_j = (g_j - sum_i g_i w_i) / s (normalized) or
    g_j, the sum over i ascending; scattered back to the selected columns (each written
    once: a token's k experts are distinct), zeros elsewhere."""

    @staticmethod
    def forward(ctx, probs, top_k: int, normalize: bool, fused: bool):  # type: ignore[override]
        if fused:
            index, top, total = _top_k_route(probs, top_k, normalize)
        else:
            index = top_k_lowest_id(probs, top_k)
            top = probs.gather(-1, index)
            total = _sum_columns(top)
            if normalize:
                top = top / total[:, None]
        if normalize:
            ctx.save_for_backward(index, top, total)
        else:
            ctx.save_for_backward(index)
        ctx.mark_non_differentiable(index)
        ctx.normalize, ctx.shape = normalize, probs.shape
        return top, index

    @staticmethod
    def backward(ctx, grad, _grad_index):  # type: ignore[override]
        if ctx.normalize:
            index, w, total = ctx.saved_tensors
            dot = _sum_columns(grad * w)
            dtop = (grad - dot[:, None]) / total[:, None]
        else:
            (index,) = ctx.saved_tensors
            dtop = grad
        dprobs = torch.zeros(ctx.shape, dtype=dtop.dtype, device=dtop.device)
        return dprobs.scatter_(-1, index, dtop), None, None, None


def _sum_columns(x: torch.Tensor) -> torch.Tensor:
    """sum_j x[:, j] as a chain of elementwise adds, j ascending: an order fixed by k alone
    (ATen's reduction over a short dim picks its vectorisation from the whole shape)."""
    total = x[:, 0].clone()
    for j in range(1, x.shape[1]):
        total = total + x[:, j]
    return total


def top_k_lowest_id(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices [T, k] of each row's k largest scores, largest first; equal scores in
    ascending index order. ``torch.topk`` promises no order among equal values; a stable
    descending sort keeps equal values in index order."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def _top_k_route(src: torch.Tensor, top_k: int, normalize: bool, *, from_logits: bool = False,
                 round_weights_to: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """(index [T, k] int64, w [T, k] fp32, total [T] fp32) in one launch, from fp32 probs
    [T, E], or with ``from_logits`` from logits [T, E] through ``softmax_forward``'s chain
    (E <= 1024, the lanes of its row sum; the weights then rounded to ``round_weights_to``
    and back, as :func:`moe_topk` does after the Function)."""
    T, E = src.shape
    src = src.contiguous()
    index = torch.empty(T, top_k, dtype=torch.int64, device=src.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=src.device)
    total = torch.empty(T, dtype=torch.float32, device=src.device)
    if T:
        block_e = ROW_BLOCK if from_logits else pow2_at_least(E, 16)
        _launch_top_k((T,), (src, index, weights, total, E, src.stride(0), index.stride(0), weights.stride(0)),
                      dict(K=top_k, NORMALIZE=normalize, SOFTMAX=from_logits, ROUND=_ROUND_CODES[round_weights_to],
                           BLOCK_E=block_e), num_warps=4, num_stages=1)
    return index, weights, total


def _fuses_route(probs: torch.Tensor, backend_name: str) -> bool:
    """Whether the routing's top-k runs as one Triton launch (fp32 probs, E within one tile)."""
    return (backend_name == "triton" and _launch_top_k is not None and probs.dtype == torch.float32
            and probs.shape[1] <= ROUTE_MAX_EXPERTS)


def _fuses_softmax_route(logits: torch.Tensor, backend_name: str, round_weights_to: torch.dtype | None) -> bool:
    """Whether softmax, top-k and weights come from one launch: no autograd, a GPU (the
    kernel's expf is CUDA's, the interpreter's is numpy's), 16/32-bit logits, E within the
    1024 lanes of the softmax's row sum."""
    return (backend_name == "triton" and _launch_top_k is not None and logits.is_cuda
            and logits.dtype in (torch.float32, torch.float16, torch.bfloat16) and logits.shape[1] <= ROW_BLOCK
            and round_weights_to in _ROUND_CODES and not (torch.is_grad_enabled() and logits.requires_grad))


def moe_topk(logits: torch.Tensor, top_k: int, *, normalize: bool = True,
             round_weights_to: torch.dtype | None = None,
             backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token: (weights [T, k] fp32, expert ids [T, k] int64), from logits [T, E]
    (fp64 logits: fp64 weights, for references and gradcheck).

    ``probs = softmax(logits.float())`` (fixed-order row sum); the k largest, largest
    first, equal probabilities to the lowest expert id; with ``normalize`` each divided
    by their sum (ascending rank). ``round_weights_to``: round the weights to that dtype
    (and back), as Qwen2-MoE / Qwen3-MoE do (they cast the routing weights to the
    logits' dtype). Autograd flows to ``logits``; the ids have none.
    """
    op = "moe_topk"
    V.require_tensor(op, "logits", logits)
    V.require_float(op, "logits", logits)
    V.require_ndim(op, "logits", logits, 2, 2)
    E = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"rlkernels.{op}: top_k must be an int in [1, {E}] (the number of experts), got {top_k!r}")
    if round_weights_to is not None and not isinstance(round_weights_to, torch.dtype):
        raise TypeError(f"rlkernels.{op}: round_weights_to must be None or a float torch.dtype (torch.bfloat16, "
                        f"torch.float16, torch.float32), got {round_weights_to!r}")
    if round_weights_to is not None and not round_weights_to.is_floating_point:
        raise ValueError(f"rlkernels.{op}: round_weights_to must be a float dtype (the routing weights are "
                         f"probabilities), got {round_weights_to}")
    acc = accumulator_dtype(logits.dtype)
    try:
        reductions = reduction_backend_for("softmax", logits.device, backend)
    except BackendUnavailableError as exc:  # the router's softmax is this op's: say so
        raise BackendUnavailableError(str(exc).replace("rlkernels.softmax", f"rlkernels.{op}")) from None
    if _fuses_softmax_route(logits, reductions.name, round_weights_to):
        index, weights, _ = _top_k_route(logits, top_k, bool(normalize), from_logits=True,
                                         round_weights_to=round_weights_to)
        return weights, index
    probs = softmax(logits, -1, dtype=acc, backend=reductions.name)
    weights, index = _TopKWeightsFunction.apply(probs, top_k, bool(normalize), _fuses_route(probs, reductions.name))
    if round_weights_to is not None:
        weights = weights.to(round_weights_to).to(acc)
    return weights, index


# ---------------------------------------------------------------- experts


def _silu(g: torch.Tensor) -> torch.Tensor:
    """silu with per-element bits: the fixed chain on the CPU (ATen's vector tail rounds
    differently), ATen's elementwise kernel on GPUs (ops.activations)."""
    return silu_chain(g) if g.device.type == "cpu" else F.silu(g)


def _sigmoid(g: torch.Tensor) -> torch.Tensor:
    """sigmoid with per-element bits, as :func:`_silu`."""
    return sigmoid_chain(g) if g.device.type == "cpu" else torch.sigmoid(g)


@dataclass(frozen=True)
class GatedActivation:
    """How an expert's gate/up output gu [n, 2I] becomes its hidden state h [n, I].

    ``interleaved``: gate and up alternate by column, the gate first (GPT-OSS); else the
    gate is the first half (transformers' fused ``*Experts``). ``limit`` None:
    h = silu(gate) * up. A float (GPT-OSS's clamped SwiGLU): gate = min(gate, limit),
    up = clamp(up, -limit, limit), h = (up + 1) * (gate * sigmoid(gate * alpha)). Each op
    rounds to gu's dtype as torch's elementwise op does; silu and sigmoid run the fixed
    chains on the CPU."""

    interleaved: bool = False
    limit: float | None = None
    alpha: float = 1.0

    def split(self, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate [n, I], up [n, I]) views of gu [n, 2I]."""
        if self.interleaved:
            return gu[:, 0::2], gu[:, 1::2]
        inter = gu.shape[1] // 2
        return gu[:, :inter], gu[:, inter:]

    def join(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """[n, 2I] with gate and up in :meth:`split`'s columns."""
        if self.interleaved:
            return torch.stack((gate, up), dim=-1).flatten(-2)
        return torch.cat((gate, up), dim=-1)

    def forward(self, gu: torch.Tensor) -> torch.Tensor:
        """h [n, I] in gu's dtype."""
        gate, up = self.split(gu)
        if self.limit is None:
            return _silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * _sigmoid(gate * self.alpha))

    def backward(self, dh: torch.Tensor, gu: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(d gu [n, 2I] in ``dtype``, h [n, I]) from dh [n, I] in the accumulator dtype:
        elementwise, so a row's bits do not depend on which rows are beside it. A clamp
        passes the gradient where its input lies within the bounds, ends included (torch's
        clamp backward)."""
        acc = dh.dtype
        gate, up = self.split(gu)
        h = self.forward(gu)
        gf, uf = gate.to(acc), up.to(acc)
        if self.limit is None:
            sig = 1 / (1 + torch.exp(-gf))
            d_gate = dh * uf * (sig * (1 + gf * (1 - sig)))
            d_up = dh * _silu(gate).to(acc)
        else:
            gc, uc = gf.clamp(max=self.limit), uf.clamp(min=-self.limit, max=self.limit)
            sig = 1 / (1 + torch.exp(-(gc * self.alpha)))
            glu = gc * sig
            d_gate = dh * (uc + 1) * (sig + self.alpha * glu * (1 - sig)) * (gf <= self.limit)
            d_up = dh * glu * ((uf >= -self.limit) & (uf <= self.limit))
        return self.join(d_gate, d_up).to(dtype), h


SILU_GATE = GatedActivation()


@dataclass(frozen=True)
class _Experts:
    """One layer's experts as the GEMMs read them: ``gate_up`` [E, 2I, H] and ``down`` [E, H, I]
    (views of [E, H, 2I] and [E, I, H] parameters where those are transposed), the biases
    [E, 2I] and [E, H] or None, and the activation."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    act: GatedActivation

    @classmethod
    def of(cls, gate_up, down, gate_up_bias, down_bias, act: GatedActivation, transposed: bool) -> "_Experts":
        if transposed:
            gate_up, down = gate_up.mT, down.mT
        return cls(gate_up, down, gate_up_bias, down_bias, act)

    @property
    def fuses_silu_up(self) -> bool:
        """The grouped gate/up launch can apply the activation in its epilogue (CUDA)."""
        return self.act == SILU_GATE and self.gate_up_bias is None


class _Routing:
    """The (token, rank) slots grouped by expert: slot s = t * k + r.

    ``ids``: each slot's expert; ``order``: the slots sorted by expert id, stably
    (ascending slot, hence ascending token, within an expert); ``sorted_ids``: the expert
    of each sorted slot; ``slot_end`` [E] on the device: where each expert's sorted slots
    end (a search in the sorted ids: no count is read on the host, so the grouped forward
    launches without a sync). ``counts`` and ``inverse`` are worked out when first asked
    for: the per-expert loops (the torch backend) read the counts on the host.

    The expert ids are range-checked before any launch wherever they can be read back
    (one sync); during a CUDA-graph capture or a torch.compile trace they cannot, and are
    not checked (an id outside [0, E) then gives that slot garbage, never an access
    outside the tensors)."""

    def __init__(self, index: torch.Tensor, num_experts: int, op: str, check: bool = True) -> None:
        flat = index.reshape(-1)
        if check and can_read_back(flat):
            bad = (flat < 0) | (flat >= num_experts)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                k = index.shape[1]
                raise ValueError(f"rlkernels.{op}: top_k_index[{i // k}, {i % k}] = {int(flat[i])} is not an "
                                 f"expert id in [0, {num_experts})")
        self.ids = flat
        self.sorted_ids, self.order = torch.sort(flat, stable=True)
        experts = torch.arange(num_experts, device=flat.device, dtype=self.sorted_ids.dtype)
        self.slot_end = torch.searchsorted(self.sorted_ids, experts, right=True)
        self.k = index.shape[1]
        self.slots = flat.numel()
        self._counts: list[int] | None = None
        self._inverse: torch.Tensor | None = None

    @property
    def tokens(self) -> torch.Tensor:
        """The token of each sorted slot."""
        return self.order // self.k

    @property
    def counts(self) -> list[int]:
        """The slots of each expert, on the host (a sync)."""
        if self._counts is None:
            ends = self.slot_end.tolist()
            self._counts = [end - start for start, end in zip([0] + ends[:-1], ends)]
        return self._counts

    @property
    def inverse(self) -> torch.Tensor:
        """The inverse permutation of ``order``."""
        if self._inverse is None:
            self._inverse = torch.empty_like(self.order)
            self._inverse[self.order] = torch.arange(self.slots, device=self.order.device)
        return self._inverse

    def spans(self):
        """(expert, start, end) over the sorted slots, for every expert that received any."""
        start = 0
        for e, n in enumerate(self.counts):
            if n:
                yield e, start, start + n
            start += n


def sum_ranks(slots: torch.Tensor, weights: torch.Tensor | None, out_dtype: torch.dtype,
              fused: bool) -> torch.Tensor:
    """sum_r (weights[:, r] *) slots[:, r] over [T, k, H], in slots' dtype (fp32; fp64 for
    fp64), r ascending, rounded once to ``out_dtype``: [T, H].

    ``fused`` (the Triton backend): one launch (``kernels.moe.rank_sum_kernel``); else k
    multiplies and k - 1 adds as elementwise torch ops. The same roundings in the same
    order, so the same bits."""
    T, k, H = slots.shape
    # The interpreter stores bf16 by truncation, not round-to-nearest-even as a GPU does.
    if fused and slots.dtype == torch.float32 and T and H and not (triton_interpret() and out_dtype == torch.bfloat16):
        slots = slots if slots.stride(2) == 1 else slots.contiguous()
        if weights is not None and weights.stride(1) != 1:  # the kernel steps over ranks with unit stride
            weights = weights.contiguous()
        out = torch.empty(T, H, dtype=out_dtype, device=slots.device)
        w = weights if weights is not None else slots  # unread without WEIGHTED
        block_h = min(RANK_SUM_BLOCK_H, pow2_at_least(H, 16))
        _launch_rank_sum((T, cdiv(H, block_h)), (slots, w, out, H, slots.stride(0), slots.stride(1),
                                                 w.stride(0), out.stride(0)),
                         dict(K=k, WEIGHTED=weights is not None, BLOCK_H=block_h), num_warps=4, num_stages=1)
        return out
    if weights is not None:
        weights = weights.to(slots.dtype)
    out = slots[:, 0] * weights[:, 0, None] if weights is not None else slots[:, 0].clone()
    for r in range(1, k):
        out = out + (slots[:, r] * weights[:, r, None] if weights is not None else slots[:, r])
    return out.to(out_dtype)


def experts_forward(gemm_backend, x: torch.Tensor, weights: torch.Tensor, p: _Experts, routing: _Routing,
                    keep: bool, out_dtype: torch.dtype, grouped: bool):
    """The output [T, H] (the fp32 combine, rounded once to ``out_dtype``) and, with
    ``keep``, what the backward reads: (gate_up outputs, bias added, in sorted slot order
    [T*k, 2I] in x's dtype, y in slot order [T*k, H] fp32).

    gate_up: each slot's row of x times its expert's weight, rounded to x's dtype, plus the
    expert's bias (an add in x's dtype, as ``x @ W + b`` rounds); the activation; down in
    fp32, plus its bias in fp32. ``grouped`` (the Triton backend) runs each projection as
    one grouped launch over all experts, else one GEMM per expert that received tokens
    (the counts read on the host); a slot's bits are the same either way. On CUDA the
    grouped gate/up launch applies ``silu(gate) * up`` itself where the experts are the
    stock SiLU ones without a bias (the bits of ATen's silu and mul, which ``_silu`` runs
    there). Under the interpreter ``_silu``'s CPU chain uses torch's exp, which the
    interpreter's numpy exp does not match bit for bit, so h is made from the stored
    gate_up outputs there."""
    acc = accumulator_dtype(x.dtype)
    if grouped and x.is_cuda and p.fuses_silu_up:
        h, gu_sorted = grouped_gemm(x, p.gate_up, routing.slot_end, routing.slots, a_rows=routing.tokens,
                                    silu_up=True, keep_gate_up=keep, config=grouped_config(routing.slots, x.dtype))
    else:
        gu_sorted = _gate_up(gemm_backend, x, p, routing, grouped)
        h = p.act.forward(gu_sorted)
    y = _down(gemm_backend, h, p.down, routing, grouped)
    if p.down_bias is not None:
        y = y + p.down_bias.to(acc).index_select(0, routing.ids)
    T, H = x.shape
    out = sum_ranks(y.view(T, routing.k, H), weights, out_dtype, fused=grouped)
    return out, (gu_sorted if keep else None, y if keep else None)


def _gate_up(gemm_backend, x: torch.Tensor, p: _Experts, routing: _Routing, grouped: bool) -> torch.Tensor:
    """gu in sorted slot order [T*k, 2I], x's dtype, the experts' biases added."""
    if grouped:
        # A's row of a sorted slot is its token's row of x, gathered in the kernel.
        gu, _ = grouped_gemm(x, p.gate_up, routing.slot_end, routing.slots, a_rows=routing.tokens,
                             config=grouped_config(routing.slots, x.dtype))
    else:
        rows = x.index_select(0, routing.tokens)
        gu = torch.empty(routing.slots, p.gate_up.shape[1], dtype=x.dtype, device=x.device)
        for e, s0, s1 in routing.spans():
            gu[s0:s1] = gemm_backend.gemm(rows[s0:s1], p.gate_up[e], b_transposed=True)
    if p.gate_up_bias is not None:
        gu = gu + p.gate_up_bias.index_select(0, routing.sorted_ids)
    return gu


def _down(gemm_backend, h: torch.Tensor, down: torch.Tensor, routing: _Routing, grouped: bool) -> torch.Tensor:
    """y = h @ down_e^T in (token, rank) slot order [T*k, H], fp32: the canonical chain's
    sums, rounded once after the combine, not here."""
    acc = accumulator_dtype(h.dtype)
    if grouped:  # each sorted slot's row is written straight to its (token, rank) slot
        y, _ = grouped_gemm(h, down, routing.slot_end, routing.slots, c_rows=routing.order, out_dtype=acc,
                            config=grouped_config(routing.slots, h.dtype))
        return y
    y_sorted = torch.empty(routing.slots, down.shape[1], dtype=acc, device=h.device)
    for e, s0, s1 in routing.spans():
        y_sorted[s0:s1] = gemm_backend.gemm(h[s0:s1], down[e], b_transposed=True, out_dtype=acc)
    return y_sorted.index_select(0, routing.inverse)  # back to (token, rank) slots: a gather


def _expert_grads(op: str, param: torch.Tensor | None, need: bool, grouped: bool, what: str
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the .grad to return or None, the fp32 main_grad to accumulate into or None). The
    grouped weight gradient writes every expert's slice, zeros where no token came; the
    per-expert loop writes only the experts that received tokens, so its .grad starts zeroed."""
    if not need or param is None:
        return None, None
    main = main_grad_target(op, param, tuple(param.shape), what)
    if main is not None:
        return None, main
    return (torch.empty_like(param) if grouped else torch.zeros_like(param)), None


def _weight_grads(gemm_backend, a: torch.Tensor, b: torch.Tensor, b_rows: torch.Tensor | None, routing: _Routing,
                  grad: torch.Tensor | None, main: torch.Tensor | None, grouped: bool) -> None:
    """dW_e = a[slots of e]^T @ b[rows of those slots] for every expert: the canonical chain
    over the expert's slots ascending (its tokens in order), fp32, rounded once into
    ``grad[e]`` or continuing ``main[e]``'s chain. ``grouped``: one launch
    (``gemm.grouped.grouped_wgrad``, b's rows read through ``b_rows`` in the kernel; an
    expert with no token gets zeros or keeps main's values); else one GEMM per expert that
    received tokens, the same chains."""
    if grouped:
        if main is not None:
            grouped_wgrad(a, b, routing.slot_end, b_rows=b_rows, out=main, accumulate=True)
        else:
            grouped_wgrad(a, b, routing.slot_end, b_rows=b_rows, out=grad)
        return
    rows = b if b_rows is None else b.index_select(0, b_rows)
    for e, s0, s1 in routing.spans():
        if main is not None:
            gemm_backend.gemm(a[s0:s1].t(), rows[s0:s1], out=main[e], accumulate=True)
        else:
            grad[e].copy_(gemm_backend.gemm(a[s0:s1].t(), rows[s0:s1], out_dtype=grad.dtype))


def _bias_grads(gemm_backend, d: torch.Tensor, routing: _Routing, grad: torch.Tensor | None,
                main: torch.Tensor | None, grouped: bool) -> None:
    """d bias_e = the sum of d's rows over the expert's slots: :func:`_weight_grads` against a
    column of ones, so the same chain over the same tokens."""
    ones = d.new_ones(routing.slots, 1)
    _weight_grads(gemm_backend, d, ones, None, routing, None if grad is None else grad[..., None],
                  None if main is None else main[..., None], grouped)


def experts_backward(gemm_backend, g: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, p: _Experts,
                     gu_sorted: torch.Tensor, routing: _Routing, needs: tuple[bool, ...], grads, grouped: bool
                     ) -> torch.Tensor | None:
    """dX [T, H] or None from g = dOut [T, H] fp32, and the weight and bias gradients written
    into ``grads``: (grad, main) pairs for gate_up, down, gate_up_bias, down_bias, in the
    orientation of ``p``'s views. ``needs``: (dX, d gate_up, d down, d gate_up_bias,
    d down_bias).

    dh = dY @ down_e and dX = d gu @ gate_up_e run like the forward's GEMMs (grouped: one
    launch each, dX rows straight to their (token, rank) slots, B read through the
    transposed views ``down.mT`` and ``gate_up.mT``, no copy of a weight); the activation's
    backward is elementwise over all slots at once; each weight gradient is a chain over
    its expert's tokens ascending (:func:`_weight_grads`). No count is read on the host on
    the grouped path. A slot's rows and an expert's gradients are the same chains on either
    path, so the bits are the same."""
    need_x, need_gu, need_down, need_gu_bias, need_down_bias = needs
    (grad_gu, main_gu), (grad_down, main_down), (grad_gub, main_gub), (grad_db, main_db) = grads
    T, H = x.shape
    k, slots = routing.k, routing.slots
    acc = accumulator_dtype(x.dtype)
    # d out / d y_{t,r} = w_{t,r} g_t, rounded to x's dtype as a linear's dY is.
    dy_slots = (weights.to(acc)[:, :, None] * g[:, None, :]).view(T * k, H)
    dy_sorted = dy_slots.index_select(0, routing.order).to(x.dtype)
    dgu = h = None
    if need_x or need_gu or need_gu_bias:
        if grouped:
            dh, _ = grouped_gemm(dy_sorted, p.down.mT, routing.slot_end, slots, out_dtype=acc,
                                 config=grouped_config(slots, x.dtype))
        else:
            dh = torch.empty(slots, p.down.shape[2], dtype=acc, device=x.device)
            for e, s0, s1 in routing.spans():
                dh[s0:s1] = gemm_backend.gemm(dy_sorted[s0:s1], p.down[e], out_dtype=acc)
        dgu, h = p.act.backward(dh, gu_sorted, x.dtype)
    if need_down:
        _weight_grads(gemm_backend, dy_sorted, p.act.forward(gu_sorted) if h is None else h, None, routing,
                      grad_down, main_down, grouped)
    if need_down_bias:
        _bias_grads(gemm_backend, dy_sorted, routing, grad_db, main_db, grouped)
    if need_gu:
        _weight_grads(gemm_backend, dgu, x, routing.tokens, routing, grad_gu, main_gu, grouped)
    if need_gu_bias:
        _bias_grads(gemm_backend, dgu, routing, grad_gub, main_gub, grouped)
    if not need_x:
        return None
    if grouped:
        dx, _ = grouped_gemm(dgu, p.gate_up.mT, routing.slot_end, slots, c_rows=routing.order, out_dtype=acc,
                             config=grouped_config(slots, x.dtype))
    else:
        dx_sorted = torch.empty(slots, H, dtype=acc, device=x.device)
        for e, s0, s1 in routing.spans():
            dx_sorted[s0:s1] = gemm_backend.gemm(dgu[s0:s1], p.gate_up[e], out_dtype=acc)
        # Experts nobody chose leave no slot; every slot of a token holds its expert's dX.
        dx = dx_sorted.index_select(0, routing.inverse)
    # A token's dX: the fp32 sum of its k slots, ascending rank, rounded once.
    return sum_ranks(dx.view(T, k, H), None, x.dtype, fused=grouped)


class _MoeExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, gate_up, down, gate_up_bias, down_bias, routing, gemm_backend,  # type: ignore[override]
                out_dtype, act, transposed):
        p = _Experts.of(gate_up, down, gate_up_bias, down_bias, act, transposed)
        out, (gu_sorted, y) = experts_forward(gemm_backend, x, weights, p, routing, keep=True, out_dtype=out_dtype,
                                              grouped=gemm_backend.name == "triton")
        ctx.save_for_backward(x, weights, gate_up, down, gate_up_bias, down_bias, gu_sorted, y)
        ctx.routing, ctx.gemm_backend, ctx.act, ctx.transposed = routing, gemm_backend, act, transposed
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weights, gate_up, down, gate_up_bias, down_bias, gu_sorted, y = ctx.saved_tensors
        routing, gemm_backend, transposed = ctx.routing, ctx.gemm_backend, ctx.transposed
        need_x, need_w, *need_params = ctx.needs_input_grad[:6]
        T, H = x.shape
        k = routing.k
        g = grad_out.to(accumulator_dtype(x.dtype))
        grad_w = None
        if need_w:
            # d out_t / d w_{t,r} = y_{t,r}: one fixed-order dot per slot.
            reduce = _REDUCTIONS[gemm_backend.name]
            g_slots = g[:, None, :].expand(T, k, H).reshape(T * k, H)
            grad_w = reduce.row_dot(g_slots, y).view(T, k).to(weights.dtype)
        grouped = gemm_backend.name == "triton"
        params = (gate_up, down, gate_up_bias, down_bias)
        names = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")
        raw = [_expert_grads("moe_experts", t, need, grouped, name)
               for t, need, name in zip(params, need_params, names)]
        # The weights' gradients are written through the views the GEMMs read.
        views = [tuple(None if t is None else (t.mT if transposed and i < 2 else t) for t in pair)
                 for i, pair in enumerate(raw)]
        grad_x = None
        if need_x or any(need_params):
            p = _Experts.of(gate_up, down, gate_up_bias, down_bias, ctx.act, transposed)
            grad_x = experts_backward(gemm_backend, g, x, weights, p, gu_sorted, routing,
                                      (need_x, *(n and t is not None for n, t in zip(need_params, params))),
                                      views, grouped)
        return (grad_x, grad_w, *(pair[0] for pair in raw), None, None, None, None, None)


def validate_moe_experts(op: str, x, index, weights, gate_up, down, gate_up_bias=None, down_bias=None,
                         transposed: bool = False) -> None:
    for name, t in (("hidden_states", x), ("top_k_index", index), ("top_k_weights", weights),
                    ("gate_up_proj", gate_up), ("down_proj", down)):
        V.require_tensor(op, name, t)
    for name, t in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if t is not None:
            V.require_tensor(op, name, t)
            V.require_float(op, name, t)
            V.require_ndim(op, name, t, 2, 2)
    V.require_float(op, "hidden_states", x)
    V.require_float(op, "gate_up_proj", gate_up)
    V.require_float(op, "down_proj", down)
    V.require_float(op, "top_k_weights", weights)
    V.require_ndim(op, "hidden_states", x, 2, 2)
    V.require_ndim(op, "gate_up_proj", gate_up, 3, 3)
    V.require_ndim(op, "down_proj", down, 3, 3)
    V.require_ndim(op, "top_k_index", index, 2, 2)
    biases = {n: t for n, t in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)) if t is not None}
    V.require_same_device(op, hidden_states=x, top_k_index=index, top_k_weights=weights, gate_up_proj=gate_up,
                          down_proj=down, **biases)
    V.require_same_dtype(op, hidden_states=x, gate_up_proj=gate_up, down_proj=down, **biases)
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"rlkernels.{op}: top_k_index must be int64 or int32, got {index.dtype}")
    T, H = x.shape
    if transposed:
        E, h_in, two_i = gate_up.shape
        layout, down_want = "[E, H, 2 * I]", (E, two_i // 2, H)
    else:
        E, two_i, h_in = gate_up.shape
        layout, down_want = "[E, 2 * I, H]", (E, H, two_i // 2)
    if h_in != H or two_i % 2:
        raise ValueError(f"rlkernels.{op}: gate_up_proj must be {layout} with H = {H} (hidden_states' last "
                         f"dim), got {tuple(gate_up.shape)}")
    if tuple(down.shape) != down_want:
        raise ValueError(f"rlkernels.{op}: down_proj must be {'[E, I, H]' if transposed else '[E, H, I]'} = "
                         f"{down_want} to match gate_up_proj {tuple(gate_up.shape)}, got {tuple(down.shape)}")
    for name, t, want in (("gate_up_bias", gate_up_bias, (E, two_i)), ("down_bias", down_bias, (E, H))):
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"rlkernels.{op}: {name} must be {want} (one row per expert), got {tuple(t.shape)}")
    if index.shape[0] != T or tuple(weights.shape) != tuple(index.shape):
        raise ValueError(f"rlkernels.{op}: top_k_index and top_k_weights must both be [T, k] with T = {T}, got "
                         f"{tuple(index.shape)} and {tuple(weights.shape)}")
    if index.shape[1] < 1 or index.shape[1] > E:
        raise ValueError(f"rlkernels.{op}: k = {index.shape[1]} experts per token, expected 1 .. {E} (the experts "
                         "in gate_up_proj)")


def _check_activation(op: str, activation: object) -> GatedActivation:
    if not isinstance(activation, GatedActivation):
        raise TypeError(f"rlkernels.{op}: activation must be a rlkernels.ops.moe.GatedActivation, got {activation!r}")
    limit, alpha = activation.limit, activation.alpha
    for name, value in (("limit", limit), ("alpha", alpha)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ValueError(f"rlkernels.{op}: the activation's {name} must be a finite number, got {value!r}")
    if limit is not None and limit <= 0:
        raise ValueError(f"rlkernels.{op}: the activation's limit must be > 0, got {limit!r}")
    return activation


def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, activation: GatedActivation = SILU_GATE,
                transposed: bool = False, out_dtype: torch.dtype | None = None, check_ids: bool = True,
                backend: str | None = None) -> torch.Tensor:
    """sum_r w[t, r] * (down_e(act(gate_up_e(x_t))) + down_bias_e), e = top_k_index[t, r]: [T, H].

    hidden_states [T, H] (bf16/fp16/fp32; fp64 on the torch backend); top_k_index [T, k]
    int64/int32 expert ids (a token's k ids distinct, as a top-k gives them); top_k_weights
    [T, k] (any float dtype, used in fp32); gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    (transformers' fused ``*Experts`` layout), or with ``transposed`` [E, H, 2I] and
    [E, I, H] (GPT-OSS: ``x @ W[e]``); gate_up_bias [E, 2I] and down_bias [E, H] or None.
    ``activation`` (:class:`GatedActivation`): where the gate and up columns sit and the
    formula; the default is ``silu(gate) * up`` with the gate in the first half.

    gate_up_e(x) is the canonical chain rounded to x's dtype, then its bias added in x's
    dtype; down_e in fp32 plus its bias in fp32. The combine is fp32 in ascending rank
    order, rounded once to ``out_dtype`` (default hidden_states' dtype; fp32 keeps it
    unrounded so a block can add a shared expert first). A token's output is a function of
    its own row, ids and weights alone. Autograd to hidden_states, top_k_weights, both
    weights and both biases (``main_grad`` honoured). ``check_ids``: range-check the ids
    before any launch (one read back from the device); False where they come from
    :func:`moe_topk`, which only gives ids in [0, E) -- an id outside it then gives its
    slot garbage, never an access outside the tensors.
    """
    op = "moe_experts"
    if not isinstance(transposed, bool):
        raise TypeError(f"rlkernels.{op}: transposed must be a bool, got {transposed!r}")
    activation = _check_activation(op, activation)
    validate_moe_experts(op, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias,
                         down_bias, transposed)
    hidden_states, gate_up_proj, down_proj = V.autocast(hidden_states, gate_up_proj, down_proj)
    if gate_up_bias is not None:
        gate_up_bias = gate_up_bias.to(hidden_states.dtype)
    if down_bias is not None:
        down_bias = down_bias.to(hidden_states.dtype)
    out_dtype = out_dtype or hidden_states.dtype
    if out_dtype not in V.FLOAT_DTYPES_WITH_FP64:
        raise ValueError(f"rlkernels.{op}: out_dtype must be a float dtype, got {out_dtype}")
    gemm_backend = gemm_backend_for(hidden_states.device, backend)
    V.refuse_interpreted_bf16(op, gemm_backend.name, hidden_states)
    if hidden_states.dtype == torch.float64 and gemm_backend.name == "triton":
        raise ValueError(f"rlkernels.{op}: float64 runs on the torch backend only (RLKERNELS_BACKEND=torch)")
    params = [t for t in (gate_up_proj, down_proj, gate_up_bias, down_bias) if t is not None]
    T, H = hidden_states.shape
    if T == 0:
        zero = (hidden_states.sum() + top_k_weights.sum() + sum(t.sum() for t in params)) * 0
        return zero.to(out_dtype).expand(0, H).clone()
    routing = _Routing(top_k_index.long(), gate_up_proj.shape[0], op, check=check_ids)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, top_k_weights, *params)):
        return _MoeExpertsFunction.apply(hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_bias,
                                         down_bias, routing, gemm_backend, out_dtype, activation, transposed)
    # Inference (scoring, decode): the Function's forward without keeping what the backward reads.
    p = _Experts.of(gate_up_proj, down_proj, gate_up_bias, down_bias, activation, transposed)
    out, _ = experts_forward(gemm_backend, hidden_states, top_k_weights, p, routing, keep=False, out_dtype=out_dtype,
                             grouped=gemm_backend.name == "triton")
    return out


# ---------------------------------------------------------------- registry entries


class _MoeOp(OpImpl):
    """The routed experts of one MoE layer, routing included, as one op of the table."""

    op_class = "moe"

    def forward(self, x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                top_k: int, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        logits = linear(x, router, backend=self.backend)
        weights, index = moe_topk(logits, top_k, backend=self.backend)
        return moe_experts(x, index, weights, gate_up, down, out_dtype=out_dtype, backend=self.backend)

    def forward_fp32(self, x, router, gate_up, down, top_k):
        return self.forward(x, router, gate_up, down, top_k, out_dtype=accumulator_dtype(x.dtype))

    def invariance_case(self, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
        H, inter, E, k = (64, 32, 8, 2) if device.type == "cpu" else (512, 256, 16, 4)
        x = torch.randn(33, H, generator=generator).to(device=device, dtype=dtype)
        router = torch.randn(E, H, generator=generator).to(device=device, dtype=dtype)
        gate_up = (torch.randn(E, 2 * inter, H, generator=generator) / H ** 0.5).to(device=device, dtype=dtype)
        down = (torch.randn(E, H, inter, generator=generator) / inter ** 0.5).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows, router, gate_up, down, k)), x


register_backends("moe", _MoeOp, {"triton": None, "torch": None})
