"""``matmul`` / ``linear``: the batch-invariant GEMM and its training triad.

The registry's backend for each device maps to a GEMM backend object (``gemm.backends``),
whose single primitive, :meth:`gemm`, serves the forward, dX and dW; backends differ
in *how* they produce the canonical bits, never in which bits a row gets.

``linear_group(x, weights)`` is several Linear layers of one input (attention's q, k and v
projections): at decode sizes on CUDA one launch for all, each output with the bits of its
own ``linear``. ``linear_residual(x, weight, residual)`` is ``residual + linear(x, weight)``
(a decoder layer's down projection and residual add), one launch at decode sizes.

Backward: dX = dY @ W is a GEMM like the forward (rows batch-invariant);
dW = dY^T @ X reduces over tokens in ascending order into an fp32 accumulator that
starts from ``weight.main_grad`` when present, so micro-batches whose token counts
are multiples of :data:`TOKEN_BLOCK` chain exactly like one big batch; dbias is
the row sum of dY^T through the same chain, fused into the dW kernel.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import _validate as V
from .._env import triton_interpret
from ..gemm.chain import accumulator_dtype
from ..gemm.backends import TorchGemmBackend, TritonGemmBackend, gemm_backend_mode
from ..gemm.table import LINEAR_GROUP_MAX_M, LINEAR_RESIDUAL_MAX_M
from ..gemm.triton import MAX_GROUP, triton_gemm_group
from ..registry import OpImpl, backend_object, register_backends
from ..runtime.opaque import opaque_to_compile

# Token granularity of the dW/dbias chain: the tensor-core K step for 16-bit
# inputs (measured on H100: splits at multiples of 16 tokens reproduce the
# one-shot dW bit for bit, splits at 1000 or 1016 do not). The torch backend and
# the fp32 FMA chain are exact at any split; 16 is the one promise for all.
TOKEN_BLOCK = 16

_FAST_DTYPES = frozenset(V.FLOAT_DTYPES_WITH_FP64)


def _obviously_valid(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, weight_nk: bool) -> bool:
    """The common case in a few attribute reads (decode calls are host-bound);
    anything else goes through :func:`validate_matmul` for a precise error."""
    if a.dtype is not b.dtype or a.dtype not in _FAST_DTYPES or a.device != b.device or b.dim() != 2 or a.dim() < 1:
        return False
    if a.shape[-1] != (b.shape[1] if weight_nk else b.shape[0]):
        return False
    return bias is None or (bias.dtype is a.dtype and bias.device == a.device and bias.dim() == 1
                            and bias.shape[0] == (b.shape[0] if weight_nk else b.shape[1]))


def validate_matmul(op: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, *, weight_nk: bool) -> None:
    V.require_float(op, "a" if not weight_nk else "x", a)
    V.require_float(op, "b" if not weight_nk else "weight", b)
    if bias is not None:
        V.require_float(op, "bias", bias)
    V.require_ndim(op, "x" if weight_nk else "a", a, 1)
    V.require_ndim(op, "weight" if weight_nk else "b", b, 2, 2)
    names = ("x", "weight") if weight_nk else ("a", "b")
    V.require_same_device(op, **{names[0]: a, names[1]: b, "bias": bias})
    V.require_same_dtype(op, **{names[0]: a, names[1]: b, "bias": bias})
    k_b, n = (b.shape[1], b.shape[0]) if weight_nk else (b.shape[0], b.shape[1])
    if a.shape[-1] != k_b:
        raise ValueError(f"rlkernels.{op}: inner dimensions differ: input {tuple(a.shape)} has K={a.shape[-1]}, "
                         f"{'weight' if weight_nk else 'b'} {tuple(b.shape)} has K={k_b}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"rlkernels.{op}: bias must have shape ({n},), got {tuple(bias.shape)}")


def main_grad_target(op: str, param: torch.Tensor, shape: tuple[int, ...], what: str, *,
                     contiguous: bool = False) -> torch.Tensor | None:
    """``param.main_grad`` (Megatron-LM's fp32 gradient buffer) if present, validated; else None."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        return None
    if main_grad.dtype != torch.float32 or tuple(main_grad.shape) != shape or (contiguous and not main_grad.is_contiguous()):
        kind = "contiguous float32" if contiguous else "float32"
        raise ValueError(f"rlkernels.{op}: {what}.main_grad must be {kind} of shape {shape}, "
                         f"got {main_grad.dtype} {tuple(main_grad.shape)}")
    return main_grad


class GemmFunction(torch.autograd.Function):
    """y = x @ W^T + bias (``weight_nk``) or y = x @ b + bias, with the invariant triad."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_nk: bool, out_dtype, gemm_backend):  # type: ignore[override]
        K = x.shape[-1]
        x2 = x.reshape(x.shape[:-1].numel(), K)
        b = weight.t() if weight_nk else weight
        y = gemm_backend.gemm(x2, b, bias=bias, out_dtype=out_dtype)
        ctx.save_for_backward(x2, weight, bias)
        ctx.weight_nk, ctx.gemm_backend, ctx.in_shape = weight_nk, gemm_backend, x.shape
        return y.reshape(*x.shape[:-1], b.shape[1])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x2, weight, bias = ctx.saved_tensors
        grads = linear_backward(ctx.gemm_backend, grad_out, x2, weight, bias, ctx.in_shape,
                                ctx.needs_input_grad[:3], weight_nk=ctx.weight_nk)
        return (*grads, None, None, None)


def linear_backward(gemm_backend, grad_out: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, in_shape: torch.Size, needs: tuple[bool, ...], *,
                    weight_nk: bool = True, use_main_grad: bool = True):
    """(dX, dW, dbias) of y = x @ W^T + bias (``weight_nk``) or x @ W + bias: the invariant triad.

    x2: the input as [tokens, K]; needs: which of (x, weight, bias) want a gradient.
    With ``use_main_grad`` a parameter's fp32 ``main_grad`` gets dW / dbias accumulated
    into it (and None is returned for it)."""
    w_nk = weight if weight_nk else weight.t()  # [N, K] view either way
    N = w_nk.shape[0]
    dy = grad_out.reshape(-1, N).to(x2.dtype)
    grad_x = grad_w = grad_b = None
    if needs[0]:
        grad_x = gemm_backend.gemm(dy, w_nk).reshape(in_shape)
    need_w, need_b = needs[1], bias is not None and needs[2]
    if need_w or need_b:
        acc_dt = accumulator_dtype(x2.dtype)
        w_main = main_grad_target("linear", weight, tuple(weight.shape), "weight") if need_w and use_main_grad else None
        # The fused row-sum writes the bias chain through a flat pointer: contiguous only.
        b_main = (main_grad_target("linear", bias, (N,), "bias", contiguous=True)
                  if need_b and use_main_grad else None)
        rowsum = (b_main if b_main is not None else torch.zeros(N, dtype=acc_dt, device=dy.device)) if need_b else None
        if need_w and w_main is not None:
            # dW = dY^T @ X: the reduction runs over tokens, ascending, continuing main_grad's chain.
            gemm_backend.gemm(dy.t(), x2, out=w_main if weight_nk else w_main.t(), accumulate=True, rowsum=rowsum)
        elif need_w:
            # The same fp32 chain from zero, rounded once to the parameter dtype at the store.
            dw = gemm_backend.gemm(dy.t(), x2, out_dtype=weight.dtype, rowsum=rowsum)
            grad_w = dw if weight_nk else dw.t()
        else:
            # dbias alone: the same fused row-sum chain, against a one-column B.
            gemm_backend.gemm(dy.t(), x2[:, :1], out_dtype=acc_dt, rowsum=rowsum)
        if need_b and b_main is None:
            grad_b = rowsum.to(bias.dtype)
    return grad_x, grad_w, grad_b


class _MatmulOp(OpImpl):
    op_class = "matmul"
    backend_impl: TorchGemmBackend | TritonGemmBackend

    def forward(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                out_dtype: torch.dtype | None = None, weight_nk: bool = False) -> torch.Tensor:
        return _run("linear" if weight_nk else "matmul", a, b, bias, weight_nk, out_dtype, self.backend_impl)

    def forward_fp32(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                     weight_nk: bool = False) -> torch.Tensor:
        return self.forward(a, b, bias, out_dtype=accumulator_dtype(a.dtype), weight_nk=weight_nk)

    def invariance_case(self, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
        k, n = (96, 80) if device.type == "cpu" else (1024, 512)
        x = torch.randn(33, k, generator=generator).to(device=device, dtype=dtype)
        w = (torch.randn(n, k, generator=generator) / k ** 0.5).to(device=device, dtype=dtype)
        bias = torch.randn(n, generator=generator).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows, w, bias, weight_nk=True)), x


register_backends("matmul", _MatmulOp, {"triton": TritonGemmBackend(), "torch": TorchGemmBackend()})


def gemm_backend_for(device: torch.device, backend: str | None = None) -> TorchGemmBackend | TritonGemmBackend:
    """The GEMM backend object the registry picks for ``device`` (used by other ops' backward)."""
    return backend_object("matmul", device, backend)


def _run(op: str, a, b, bias, weight_nk: bool, out_dtype,
         backend: str | TorchGemmBackend | TritonGemmBackend | None):
    """The forward core: validate, then the GEMM on ``backend`` (an implementation's GEMM
    backend object, or a backend name / None for the registry's choice on a's device)."""
    V.require_tensor(op, "input", a)
    V.require_tensor(op, "weight" if weight_nk else "b", b)
    a, b, bias = V.autocast(a, b, bias)
    if not (isinstance(bias, torch.Tensor) or bias is None) or not _obviously_valid(a, b, bias, weight_nk):
        validate_matmul(op, a, b, bias, weight_nk=weight_nk)
    if out_dtype is not None and out_dtype not in V.FLOAT_DTYPES_WITH_FP64:
        want = "torch.float16, torch.bfloat16, torch.float32, torch.float64 or None"
        if not isinstance(out_dtype, torch.dtype):
            hint = f" (write torch.{out_dtype}, not the string)" if isinstance(out_dtype, str) else ""
            raise TypeError(f"rlkernels.{op}: out_dtype must be a torch.dtype ({want}), got {out_dtype!r}{hint}")
        raise ValueError(f"rlkernels.{op}: out_dtype must be one of {want}, got {out_dtype}")
    gemm_backend = gemm_backend_for(a.device, backend) if backend is None or isinstance(backend, str) else backend
    V.refuse_interpreted_bf16(op, gemm_backend.name, a)
    if a.dtype == torch.float64 and gemm_backend.name == "triton":
        raise ValueError(f"rlkernels.{op}: float64 runs on the torch backend only (RLKERNELS_BACKEND=torch)")
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad)):
        return GemmFunction.apply(a, b, bias, weight_nk, out_dtype, gemm_backend)
    # Inference (rollouts, decode): the same GEMM backend call without autograd's bookkeeping,
    # which costs more host time than a decode-size GEMM takes on the GPU.
    if a.dim() == 2:
        return gemm_backend.gemm(a, b, bias=bias, out_dtype=out_dtype, b_transposed=weight_nk)
    y = gemm_backend.gemm(a.reshape(a.shape[:-1].numel(), a.shape[-1]), b, bias=bias, out_dtype=out_dtype,
                          b_transposed=weight_nk)
    return y.reshape(*a.shape[:-1], y.shape[-1])


# Under torch.compile each call is a graph break (a Triton launch through a cached
# launcher and cuBLASLt's flag handling are not traceable); eager calls run _run itself.
_run_opaque = opaque_to_compile(_run)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``a @ b + bias``.

    a: [..., K] (bf16/fp16/fp32; fp64 on the torch backend), b: [K, N], bias: [N] or
    None, all one dtype and device; any strides. Returns [..., N] in ``out_dtype``
    (default a.dtype). Each output row is a function of its own input row alone.
    """
    return _run_opaque("matmul", a, b, bias, False, out_dtype, backend)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``F.linear``: x [..., K], weight [N, K], bias [N] -> [..., N] in
    ``out_dtype`` (default x.dtype; fp32 keeps the canonical chain's sums unrounded)."""
    return _run_opaque("linear", x, weight, bias, True, out_dtype, backend)


def fused_decode_gemm_ok(x: torch.Tensor, weights: Sequence[torch.Tensor], max_m: int) -> bool:
    """A decode-size fused GEMM launch (``linear_group``, ``linear_silu_mul``) takes these: CUDA
    on the Triton backend, one 16-bit dtype, no input needing a gradient, no autocast, [N, K]
    weights with the same k-contiguous strides, 1 to ``max_m`` rows. Anything else runs the
    separate ops (which validate)."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() >= 1):
        return False
    first = weights[0]
    for w in weights:
        if not isinstance(w, torch.Tensor) or w.dtype != x.dtype or w.device != x.device or w.dim() != 2 \
                or w.stride() != first.stride() or w.shape[1] != x.shape[-1]:
            return False
    if first.stride(1) != 1:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    k = x.shape[-1]
    if k == 0 or not 0 < x.numel() // k <= max_m or torch.is_autocast_enabled("cuda"):
        return False
    if triton_interpret() or gemm_backend_mode() == "cublaslt":
        return False
    return isinstance(gemm_backend_for(x.device), TritonGemmBackend)  # (the registry's choice: RLKERNELS_BACKEND)


def _linear_group_launch(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    k = x.shape[-1]
    outs = triton_gemm_group(x.reshape(x.numel() // k, k), weights)
    return tuple(out.reshape(*x.shape[:-1], out.shape[-1]) for out in outs)


# Under torch.compile a graph break, as every Triton launch of the library.
_linear_group_opaque = opaque_to_compile(_linear_group_launch)


def linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x, w) for w in weights)``: several Linear layers (no bias) of one input.

    x: [..., K]; weights: [N_i, K] each; returns one [..., N_i] tensor per weight in x's
    dtype, each with the bits of :func:`linear` on whatever path. Inference on CUDA with
    16-bit operands, at most ``LINEAR_GROUP_MAX_M`` rows and at most three weights of the
    same strides (attention's q, k and v projections at a decode step) runs one launch;
    everything else runs one ``linear`` per weight.
    """
    weights = tuple(weights)
    if not weights:
        raise ValueError("rlkernels.linear_group: needs at least one weight")
    if len(weights) <= MAX_GROUP and fused_decode_gemm_ok(x, weights, LINEAR_GROUP_MAX_M):
        return _linear_group_opaque(x, weights)
    return tuple(linear(x, w) for w in weights)


def _linear_residual_launch(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    k, n = x.shape[-1], weight.shape[0]
    (out,) = triton_gemm_group(x.reshape(x.numel() // k, k), (weight,), residual=residual.view(-1, n))
    return out.reshape(residual.shape)


_linear_residual_opaque = opaque_to_compile(_linear_residual_launch)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x, weight)``: a projection (no bias) and the residual add after it.

    x: [..., K]; weight: [N, K]; residual: [..., N] of x's dtype. The bits are those of
    :func:`linear` and torch's add on every path. Inference on CUDA with 16-bit operands, a
    contiguous residual and at most ``LINEAR_RESIDUAL_MAX_M`` rows runs one launch (the add
    in the GEMM's epilogue); everything else runs the two ops.
    """
    if (fused_decode_gemm_ok(x, (weight,), LINEAR_RESIDUAL_MAX_M) and isinstance(residual, torch.Tensor)
            and residual.dtype == x.dtype and residual.device == x.device and residual.is_contiguous()
            and residual.shape == (*x.shape[:-1], weight.shape[0])
            and not (torch.is_grad_enabled() and residual.requires_grad)):
        return _linear_residual_opaque(x, weight, residual)
    return residual + linear(x, weight)
