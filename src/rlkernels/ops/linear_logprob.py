"""``linear_logprob``: per-token log-prob (and entropy) of an lm head, without [N, V] logits.

    logp, entropy = linear_logprob(hidden, weight, target, bias, temperature=T,
                                   return_entropy=True)

computes, for every token row ``h`` and its target id ``t``,

    z       = (h @ W^T + b) / T                 (V logits, never stored as a whole)
    logp    = z_t - logsumexp(z)
    entropy = logsumexp(z) - sum_j softmax(z)_j * z_j

The forward is the LM head's statistics pass (``ops.lm_head.statistics``): both
backends stream the vocabulary in the LSE order (``ops.lm_head.lse``: splits of 2048
columns, tiles of 256 inside, fixed-point tile masses, splits merged in ascending
order) and keep per-row running statistics (max ``m``, ``s = sum exp(z - m)`` and
``u = sum exp(z - m) * (z - m)``), so the extra memory is O(N) plus one tile, never
O(N * V). ``s`` follows the LSE order exactly, so ``log_softmax`` of the logits
(``rlkernels.nn.LMHead``'s output) gives logp's bits at the target.

Invariance: every tile and split boundary is a function of V alone (never of N or of
a row's position), the logits are the canonical ascending D-chain (``gemm.triton``
conventions), and every per-row reduction runs over that row's own values in an
order fixed by V (the tile sums of ``s`` and ``u`` are exact fixed-point sums).
So a row's logp/entropy -- and its dhidden row -- are bitwise the same whatever else
is in the batch. dW reduces over tokens in one ascending fp32
chain per vocabulary chunk (the GEMM backend, no atomics), so it is run-to-run
deterministic and rounded once.

Backward (shared by both backends): for V chunks of ``Cv`` columns, a fused kernel
recomputes the chunk's logits and writes ``g = dL/d(h W^T + b)`` ([N, Cv], hidden
dtype); then ``dH += g @ W[chunk]`` (fp32 [N, D] accumulator chained over V
ascending), ``dW[chunk] = g^T @ H`` (one fp32 chain over tokens, rounded once, or
accumulated into ``weight.main_grad``), ``dbias[chunk] = column sums of g``. For
16-bit inputs the dH accumulator may sit in dW's last rows, written last: those
columns then take their dW after dH is final, from the last chunk's g or a recomputed
one (:func:`dw_tail_rows`), and the main loop runs wider chunks (:func:`main_loop_chunk`),
the widest with g in dW's rows not yet written (:func:`main_loop_schedule`).
"""
from __future__ import annotations

import math

import torch

from . import _validate as V_
from ..gemm.tma import TensorDescriptor, tma_layout_ok
from ..kernels._triton import cdiv
from ..kernels.linear_logprob import grad_logits_kernel
from ..registry import OpImpl, backend_object, register_backends
from ..runtime.device import sm_count
from ..runtime.launcher import cached_launcher
from .lm_head.backward_schedule import (backward_chunk, dw_tail_rows, last_chunk_start, main_loop_chunk,
                                        main_loop_schedule)
from .lm_head.config import NO_TRANSFORM, LogitTransform, kernel_operands
from .lm_head.statistics import TORCH_ROW_CHUNK, TorchHeadStatistics, TritonHeadStatistics, keep_above, torch_logits
from .lm_head.validate import head_backend, validate_head, validate_targets, validate_threshold, validate_transform
from .matmul import gemm_backend_for, main_grad_target
from ..runtime.opaque import opaque_to_compile

OP = "linear_logprob"


# ---------------------------------------------------------------------------------------
# Backends: the LM head's statistics pass (the forward), and the backward's g = dL/dlogits.
# ---------------------------------------------------------------------------------------

class TorchLinearLogprobBackend(TorchHeadStatistics):
    """The op's two fused steps as chained elementwise torch ops (any device): the head's
    statistics pass and g."""

    def grad_logits(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor,
                    lse: torch.Tensor, ent: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
                    temperature: float, v0: int, v1: int, out: torch.Tensor,
                    threshold: torch.Tensor | None = None, transform: LogitTransform = NO_TRANSFORM) -> None:
        """out[:, :] = dL/d(raw logits)[:, v0:v1] in out.dtype; with ``threshold``, of the
        truncated distribution's log-prob (0 on the logits left out); through ``transform``'s
        slope, scale * (1 - tanh^2), after the temperature's."""
        for r0 in range(0, h2.shape[0], TORCH_ROW_CHUNK):
            rows = slice(r0, r0 + TORCH_ROW_CHUNK)
            z, tanh = torch_logits(h2[rows], weight, bias, v0, v1, temperature, transform, return_tanh=True)
            z = keep_above(z, None if threshold is None else threshold[rows])
            t = tgt[rows]
            lp = z - lse[rows].to(z.dtype)[:, None]
            p = torch.exp(lp)
            gl = g_logp[rows].to(z.dtype)[:, None]
            coef = gl if g_ent is None else gl + g_ent[rows].to(z.dtype)[:, None] * (lp + ent[rows].to(z.dtype)[:, None])
            g = -(p * coef)
            cols = torch.arange(v0, v1, device=z.device)
            g = torch.where(cols[None, :] == t[:, None], g + gl, g)
            if threshold is not None:
                g = torch.where(z == -math.inf, 0.0, g)  # p * coef is 0 * inf there
            if temperature != 1.0:
                g = g / temperature
            if tanh is not None:
                g = g * (1.0 - tanh * tanh)
            if transform.scale != 1.0:
                g = g * transform.scale
            out[rows].copy_(g)


_launch_grad_logits = cached_launcher(grad_logits_kernel) if grad_logits_kernel is not None else None


class TritonLinearLogprobBackend(TritonHeadStatistics):
    """The op's two fused steps as Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1):
    the head's statistics pass and g."""

    def grad_logits(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor,
                    lse: torch.Tensor, ent: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
                    temperature: float, v0: int, v1: int, out: torch.Tensor,
                    threshold: torch.Tensor | None = None, transform: LogitTransform = NO_TRANSFORM) -> None:
        N, D = h2.shape
        if N == 0 or v1 <= v0:
            return
        cfg = self.config_for(h2.dtype)
        bias = bias.contiguous() if bias is not None else None
        h_arg, w_arg, tma = kernel_operands(h2, weight, cfg)
        num_tiles = cdiv(N, cfg.block_m) * cdiv(v1 - v0, cfg.block_v)
        sms = sm_count(h2.device)
        grid = (min(num_tiles, sms) if cfg.persistent else num_tiles,)
        g_desc = tma and cfg.tma_store and tma_layout_ok(out)
        score_args, score_modes = transform.launch_args(temperature, h2.device)
        g_arg = TensorDescriptor(out, list(out.shape), [out.stride(0), 1], [cfg.block_m, cfg.block_v]) if g_desc \
            else out
        _launch_grad_logits(
            grid,
            (h_arg, w_arg, bias if bias is not None else h2, tgt, lse, ent, g_logp,
             g_ent if g_ent is not None else g_logp, g_arg, threshold if threshold is not None else lse,
             N, weight.shape[0], D, v0, v1, *score_args,
             h2.stride(0), h2.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1)),
            dict(HAS_BIAS=bias is not None, **score_modes, HAS_GE=g_ent is not None, IEEE=h2.dtype == torch.float32,
                 EVEN_D=D % cfg.block_k == 0, TMA=tma, BLOCK_M=cfg.block_m, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
                 GROUP_M=cfg.group_m, PERSISTENT=cfg.persistent, NUM_SMS=sms, G_DESC=g_desc,
                 THRESHOLD=threshold is not None),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


# ---------------------------------------------------------------------------------------
# Autograd.
# ---------------------------------------------------------------------------------------

class LinearLogprobFunction(torch.autograd.Function):
    """(logp, entropy) [N] of rows h2 [N, D] against weight [V, D]; see the module doc."""

    @staticmethod
    def forward(ctx, h2, weight, bias, tgt, temperature: float,  # type: ignore[override]
                logprob_backend, gemm_backend, entropy: bool = True, threshold=None,
                transform: LogitTransform = NO_TRANSFORM):
        # Without entropy its sums are skipped and the output is NaN: the caller drops it,
        # and the backward then never reads it (no gradient reaches an output not returned).
        logp, ent, lse = logprob_backend.forward(h2, weight, bias, tgt, temperature, entropy, threshold, transform)
        ctx.save_for_backward(h2, weight, bias, tgt, lse, ent, threshold)
        ctx.temperature, ctx.logprob_backend, ctx.gemm_backend = temperature, logprob_backend, gemm_backend
        ctx.transform = transform
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):  # type: ignore[override]
        saved = ctx.saved_tensors
        # The kernels compute first-order gradients only: never record them in a graph.
        with torch.no_grad():
            grads = LinearLogprobFunction._grads(ctx, saved, grad_logp, grad_ent)
        if not torch.is_grad_enabled():
            return grads
        # create_graph=True: the gradients must not pass for constants of the inputs (a
        # double backward through them would silently drop this op's second-order terms).
        deps = [t for t in (*saved[:3], grad_logp, grad_ent) if t is not None and t.requires_grad]
        outs = [g for g in grads if g is not None]
        if not deps or not outs:
            return grads
        wrapped = iter(_NoDoubleBackward.apply(len(outs), *outs, *deps))
        return tuple(next(wrapped) if g is not None else None for g in grads)

    @staticmethod
    def _grads(ctx, saved, grad_logp, grad_ent):
        h2, weight, bias, tgt, lse, ent, threshold = saved
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if grad_logp is None and grad_ent is None or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None, None, None, None
        N, D = h2.shape
        vocab = weight.shape[0]
        dev, acc_dt = h2.device, lse.dtype
        valid = tgt >= 0
        # Ignored rows get exactly zero upstream gradient (so g's row is exactly 0).
        zero = torch.zeros(N, dtype=acc_dt, device=dev)
        g_logp = torch.where(valid, grad_logp.to(acc_dt), zero) if grad_logp is not None else zero
        g_ent = torch.where(valid, grad_ent.to(acc_dt), zero) if grad_ent is not None else None
        logprob_backend, gemm_backend, T = ctx.logprob_backend, ctx.gemm_backend, ctx.temperature

        w_main = main_grad_target(OP, weight, (vocab, D), "weight", contiguous=True) if need_w else None
        b_main = main_grad_target(OP, bias, (vocab,), "bias", contiguous=True) if need_b else None
        dw = None
        if need_w and w_main is None:
            dw = torch.empty(vocab, D, dtype=weight.dtype, device=dev)
        db = (b_main if b_main is not None else torch.zeros(vocab, dtype=acc_dt, device=dev)) if need_b else None

        cv = backward_chunk(N, vocab, h2.element_size())
        tail = dw_tail_rows(N, D, vocab, cv, acc_dt, dw) if need_h else None
        if tail is not None:
            # The fp32 dH accumulator lives in dW's last rows, which the main loop leaves
            # alone; their dW waits until dH is final (from the last chunk's g, kept, or
            # a recomputed one).
            ratio = torch.finfo(acc_dt).bits // (8 * dw.element_size())  # dW elements per fp32
            start = tail * D  # 16-byte aligned (dw_tail_rows); the slice holds exactly N*D fp32
            dh_acc = dw.view(-1)[start:start + N * D * ratio].view(acc_dt).view(N, D)
            dh_acc.zero_()
            main_cv, dw_end, last = main_loop_chunk(cv, D), tail, last_chunk_start(vocab, cv)
        else:
            dh_acc = torch.zeros(N, D, dtype=acc_dt, device=dev) if need_h else None
            main_cv, dw_end, last = cv, vocab, vocab

        def grad_logits(g_buf: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
            g = g_buf[:, :v1 - v0]
            logprob_backend.grad_logits(h2, weight, bias, tgt, lse, ent, g_logp, g_ent, T, v0, v1, g, threshold,
                                        ctx.transform)
            return g

        def weight_grads(g: torch.Tensor, v0: int, v1: int) -> None:
            rowsum = db[v0:v1] if need_b else None
            if need_w and D > 0:
                # dW[chunk]: one fp32 chain over all tokens (ascending), rounded once;
                # with main_grad the chain starts from it (Megatron convention).
                if w_main is not None:
                    gemm_backend.gemm(g.t(), h2, out=w_main[v0:v1], accumulate=True, rowsum=rowsum)
                else:
                    gemm_backend.gemm(g.t(), h2, out=dw[v0:v1], rowsum=rowsum)
            elif need_b:
                # With D = 0 there are no dW columns (the GEMM backend may skip an empty output and
                # its row sums with it): a zero [N, 1] operand carries the bias sums.
                gemm_backend.gemm(g.t(), h2[:, :1] if D > 0 else g.new_zeros(N, 1), out_dtype=acc_dt, rowsum=rowsum)

        def chunk(g_buf: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
            g = grad_logits(g_buf, v0, v1)
            if need_h:
                # dH chained over V ascending, chunk after chunk, in one fp32 accumulator.
                gemm_backend.gemm(g, weight[v0:v1], out=dh_acc, accumulate=True)
            if v0 < dw_end:
                # A column's dW depends on that column of g alone: any column range gives its bits.
                w1 = min(v1, dw_end)
                weight_grads(g[:, :w1 - v0], v0, w1)
            return g

        g_buf = None
        for v0, v1, g_offset in main_loop_schedule(last, main_cv, tail, N, D, h2.element_size()):
            if g_offset is not None:
                # g in dW's rows past this chunk, unwritten until a later chunk (or dH's end).
                chunk(dw.view(-1)[g_offset:g_offset + N * (v1 - v0)].view(N, v1 - v0), v0, v1)
                continue
            if g_buf is None:
                g_buf = torch.empty(N, min(main_cv, last - v0), dtype=h2.dtype, device=dev)
            chunk(g_buf, v0, v1)
        del g_buf  # freed before the last chunk's and the dH output's buffers (peak memory)
        g_last = chunk(torch.empty(N, vocab - last, dtype=h2.dtype, device=dev), last, vocab) if last < vocab \
            else None
        grad_h = dh_acc.to(h2.dtype) if need_h else None
        del dh_acc
        if dw_end < vocab:  # dH is final: the accumulator's rows of dW are free again
            kept = max(dw_end, last)
            weight_grads(g_last[:, kept - last:], kept, vocab)
            # The tail's columns before the last chunk: recomputed, in g_last's bytes (at
            # most Cv columns: one g chunk beside dhidden, the peak). Only a sliver of a
            # last chunk (tiny V or chunk) is swapped, after it is freed, for a wider one.
            rest = kept - dw_end
            if g_last.shape[1] >= min(cv // 2, rest):
                g_buf = g_last
                del g_last
            else:
                del g_last
                g_buf = torch.empty(N, min(cv, rest), dtype=h2.dtype, device=dev)
            for v0 in range(dw_end, kept, g_buf.shape[1]):
                v1 = min(kept, v0 + g_buf.shape[1])
                weight_grads(grad_logits(g_buf, v0, v1), v0, v1)
        grad_b = db.to(bias.dtype) if need_b and b_main is None else None
        return grad_h, dw, grad_b, None, None, None, None, None, None, None


class _NoDoubleBackward(torch.autograd.Function):
    """Passes linear_logprob's gradients through; differentiating them raises (see backward)."""

    @staticmethod
    def forward(ctx, n_out: int, *tensors):  # type: ignore[override]
        # The first n_out tensors are the gradients; the rest only put the inputs that
        # require grad upstream of them.
        return tuple(t.view_as(t) for t in tensors[:n_out])

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise RuntimeError(f"rlkernels.{OP}: double backward is not supported (its backward is computed by "
                           "fused kernels that are not themselves differentiable); differentiate a "
                           "logits-based log_softmax instead where second-order gradients are needed")


# ---------------------------------------------------------------------------------------
# Registry entries and the public function.
# ---------------------------------------------------------------------------------------

class _LinearLogprobOp(OpImpl):
    op_class = "linear_logprob"
    backend_impl: TorchLinearLogprobBackend | TritonLinearLogprobBackend

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, *, temperature: float = 1.0, ignore_index: int = -100,
                return_entropy: bool = False, logit_threshold: torch.Tensor | None = None,
                logit_scale: float = 1.0, logit_softcap: float = 0.0):
        return _run(hidden, weight, target, bias, temperature, ignore_index, return_entropy, self.backend,
                    self.backend_impl, logit_threshold, logit_scale, logit_softcap)

    def forward_fp32(self, *args, **kwargs):
        # Outputs are fp32 already (fp64 for fp64 inputs): the same path.
        return self.forward(*args, **kwargs)

    def invariance_case(self, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
        n, d, v = (33, 40, 257) if device.type == "cpu" else (256, 1024, 32003)
        hidden = torch.randn(n, d, generator=generator).to(device=device, dtype=dtype)
        weight = (torch.randn(v, d, generator=generator) / d ** 0.5).to(device=device, dtype=dtype)
        bias = torch.randn(v, generator=generator).to(device=device, dtype=dtype)
        target = torch.randint(0, v, (n,), generator=generator).to(device)
        target[::5] = -100

        def fn(rows: torch.Tensor):
            return self.forward(hidden[rows], weight, target[rows], bias, temperature=0.7, return_entropy=True)

        # Rows are indices into (hidden, target), so padding/shuffling moves both together.
        return fn, torch.arange(n, device=device)


register_backends(OP, _LinearLogprobOp, {"triton": TritonLinearLogprobBackend(), "torch": TorchLinearLogprobBackend()})


def backends_for(op: str, hidden: torch.Tensor, backend: str | None = None, logprob_backend=None):
    """(log-prob backend, GEMM backend) of the registry's ``linear_logprob`` backend for
    ``hidden``'s device (or ``backend``); refuses what that backend cannot run.
    ``logprob_backend``: an implementation's own object, taken as it is."""
    name = head_backend(OP, op, hidden, backend)
    if logprob_backend is None:
        logprob_backend = backend_object(OP, hidden.device, name)
    return logprob_backend, gemm_backend_for(hidden.device, name)


def _run(hidden, weight, target, bias, temperature, ignore_index, return_entropy, backend, logprob_backend=None,
         logit_threshold=None, logit_scale=1.0, logit_softcap=0.0):
    V_.require_tensor(OP, "hidden", hidden)
    V_.require_tensor(OP, "weight", weight)
    if isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor) and hidden.is_floating_point() \
            and weight.is_floating_point():
        hidden, weight, bias = V_.autocast(hidden, weight, bias)
    validate_head(OP, hidden, weight, bias, temperature)
    transform = validate_transform(OP, logit_scale, logit_softcap)
    validate_targets(OP, hidden, weight, target, bias, ignore_index)
    if logit_threshold is not None:
        validate_threshold(OP, logit_threshold, tuple(hidden.shape[:-1]), hidden.dtype, hidden.device)
    logprob_backend, gemm_backend = backends_for(OP, hidden, backend, logprob_backend)
    lead = target.shape
    h2 = hidden.reshape(target.numel(), hidden.shape[-1])  # explicit N: -1 is ambiguous when D = 0
    t1 = target.reshape(-1).to(torch.int64)
    # Kernels see -1 for ignored rows (ignore_index may itself be a valid id in [0, V)).
    tgt = torch.where(t1 == ignore_index, torch.full_like(t1, -1), t1)
    # The threshold is data (the sampler's kept set), never differentiated.
    threshold = logit_threshold.detach().reshape(-1).contiguous() if logit_threshold is not None else None
    logp, ent = LinearLogprobFunction.apply(h2, weight, bias, tgt, float(temperature), logprob_backend, gemm_backend,
                                            bool(return_entropy), threshold, transform)
    logp, ent = logp.reshape(lead), ent.reshape(lead)
    return (logp, ent) if return_entropy else logp


@opaque_to_compile
def linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                   bias: torch.Tensor | None = None, *, temperature: float = 1.0, ignore_index: int = -100,
                   return_entropy: bool = False, logit_threshold: torch.Tensor | None = None,
                   logit_scale: float = 1.0, logit_softcap: float = 0.0, backend: str | None = None):
    """Per-token log-prob (and entropy) of ``target`` under ``softmax((hidden @ weight.T + bias) / T)``.

    hidden: [..., D] bf16/fp16/fp32 (fp64 on the torch backend); weight: [V, D]
    (lm_head layout); bias: [V] or None (same dtype/device); target: [...] integer ids
    in [0, V) or ``ignore_index``. Returns logp [...] fp32 (fp64 for fp64 inputs), or
    ``(logp, entropy)`` with ``return_entropy``; ignored positions give 0 and get zero
    gradient. Differentiable w.r.t. hidden, weight, bias. Never materializes [N, V];
    each row's outputs (and dhidden row) are bitwise independent of the rest of the batch.
    Empty inputs work as the matmul they stand for: no tokens give empty outputs; D = 0
    gives logits equal to the bias (all 0 without one, so logp = -log V).
    First-order gradients only: differentiating them again (double backward after
    ``create_graph=True``) raises RuntimeError.

    ``logit_threshold``: a tensor of target's shape, fp32 (fp64 for fp64 inputs): each
    row's truncation threshold tau, as :func:`rlkernels.linear_sample` returns it with
    ``top_k``/``top_p``. The log-prob (and entropy) are then those of the truncated
    distribution ``softmax`` over the kept set ``{v : z_v >= tau}`` (z the scaled logits),
    bitwise the sampler's, and the gradient flows through the kept logits only; a target
    outside its row's kept set gets -inf. -inf keeps every logit (the untruncated
    log-prob's value); NaN is refused. Without it, the untruncated log-prob.

    ``logit_scale`` s and ``logit_softcap`` c: the logits a model makes from its head's
    output x before any temperature, ``c * tanh(x * s / c)`` (Cohere's ``logit_scale``,
    Gemma 2's ``final_logit_softcapping``; c = 0: no cap, ``x * s``), each step in fp32 as
    torch computes it; the distribution is then ``softmax(that / T)``, and the gradient
    flows through the cap's slope. The defaults leave x as it is (the same bits as without).
    """
    return _run(hidden, weight, target, bias, temperature, ignore_index, return_entropy, backend,
                logit_threshold=logit_threshold, logit_scale=logit_scale, logit_softcap=logit_softcap)
