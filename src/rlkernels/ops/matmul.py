"""``matmul`` / ``linear``: the batch-invariant GEMM and its training triad.

Engines (one per backend) expose a single primitive, :meth:`gemm`, used for the
forward, for dX and for dW; backends differ in *how* they produce the canonical
bits, never in which bits a row gets:

* ``TritonEngine`` -- the Triton chain (``ops.gemm``) from a checked-in table by M,
  and cuBLASLt without split-K for large M where a probe proved the same bits.
* ``TorchEngine`` -- the ascending elementwise chain (``ops.chain``), any device.

Backward: dX = dY @ W is a GEMM like the forward (rows batch-invariant);
dW = dY^T @ X reduces over tokens in ascending order into an fp32 accumulator that
starts from ``weight.main_grad`` when present, so micro-batches whose token counts
are multiples of :data:`TOKEN_BLOCK` chain exactly like one big batch; dbias is
the row sum of dY^T through the same chain, fused into the dW kernel.
"""
from __future__ import annotations

import torch

from .. import _mode_state
from .. import _validate as V
from ..registry import OpImpl, env_get, implementation, register, select_backend
from .chain import accumulator_dtype, chain_matmul, chain_sum
from .cublaslt import cublaslt_available, cublaslt_verified, linear_no_split_k
from .gemm import LM_HEAD_N, WIDE_N, triton_gemm

# Token granularity of the dW/dbias chain: the tensor-core K step for 16-bit
# inputs (measured on H100: splits at multiples of 16 tokens reproduce the
# one-shot dW bit for bit, splits at 1000 or 1016 do not). The torch backend and
# the fp32 FMA chain are exact at any split; 16 is the one promise for all.
TOKEN_BLOCK = 16

# cuBLASLt-no-split from this M up (same bits, proven by a probe): measured on H100
# it matches stock cuBLAS within ~3% for M >= 128, while the Triton decode tiles
# beat both at M <= 16 and cuBLASLt's heuristics can pick badly there (M=16,
# K=12288: 263 us vs 49 us). See benchmarks/results/tune_gemm_h100_run1.json.
CUBLASLT_MIN_M = 65
# Narrow outputs (N < WIDE_N) from M = 33: there cuBLASLt-no-split beat the Triton tile
# at M = 33-64 (12288 x 4096: 0.91-0.92x stock from HBM vs 0.96-0.97x; 4096^2 M = 33:
# 1.02-1.03x vs 1.06-1.08x, equal at 48-64), while on wide outputs the Triton tiles
# win (lm head 0.93-0.95x vs 1.00x) (benchmarks/results/explore_mid_m_h100_session12.json).
CUBLASLT_MIN_M_NARROW = 33
# lm heads (N >= LM_HEAD_N) keep the Triton 128x128x128 tile up to M = 128, one row of
# tiles that streams the weight once: at M = 128 it ran 0.97x stock in four grid runs
# (455-459 vs 470-472 us) where cuBLASLt-no-split ran 1.00x (grid runs 12, 14, 15, 16).
# With two rows of tiles it is far slower (M = 192 / 256: 1.38x / 1.33x vs 1.00x;
# benchmarks/results/explore_mid_m_128_256_h100_session12.json).
CUBLASLT_MIN_M_LM_HEAD = 129


def cublaslt_min_m(n: int) -> int:
    """The smallest M the auto dispatcher sends to cuBLASLt-no-split for N outputs."""
    if n >= LM_HEAD_N:
        return CUBLASLT_MIN_M_LM_HEAD
    return CUBLASLT_MIN_M if n >= WIDE_N else CUBLASLT_MIN_M_NARROW


class TorchEngine:
    name = "torch"

    def gemm(self, a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             accumulate: bool = False, rowsum: torch.Tensor | None = None,
             b_transposed: bool = False) -> torch.Tensor:
        if b_transposed:
            b = b.t()
        acc = chain_matmul(a, b, acc=out if accumulate else None)
        if rowsum is not None:
            chain_sum(a, -1, acc=rowsum)
        if accumulate:
            return acc
        if bias is not None:
            acc = acc + bias.to(acc.dtype)
        result = acc.to(out_dtype or a.dtype)
        if out is not None:
            out.copy_(result)
            return out
        return result


def gemm_backend_mode() -> str:
    mode = (env_get("RLKERNELS_GEMM_BACKEND") or "auto").strip().lower() or "auto"
    if mode not in ("auto", "triton", "cublaslt"):
        raise ValueError(f"RLKERNELS_GEMM_BACKEND={mode!r}: expected auto, triton or cublaslt")
    return mode


def aligned_16_bytes(k: int, n: int) -> bool:
    """K and N multiples of 8 elements (16-byte rows for 16-bit types).

    cuBLASLt's bits were proven equal to the chain on such shapes only; with N = 8191
    it gave different bits for a few outputs per row (H100, test_matmul_gpu.py), so
    unaligned problems stay on the Triton chain.
    """
    return k % 8 == 0 and n % 8 == 0


# use_cublaslt's answers by everything it reads (see TritonEngine.cublaslt_route);
# bounded like the launch plans.
_CUBLASLT_ROUTES: dict[tuple, bool] = {}
MAX_CUBLASLT_ROUTES = 4096


class TritonEngine:
    name = "triton"

    def use_cublaslt(self, a: torch.Tensor, n: int, bias: torch.Tensor | None) -> bool:
        mode = gemm_backend_mode()
        # In the mode F.linear is itself overridden (to Triton): no detour through it.
        if mode == "triton" or _mode_state.overrides_installed():
            return False
        ok = cublaslt_available(a.device, a.dtype)
        if mode == "cublaslt":
            if not ok or not cublaslt_verified(a.device, a.dtype, a.shape[-1], bias is not None):
                raise RuntimeError(
                    f"rlkernels.matmul: RLKERNELS_GEMM_BACKEND=cublaslt but cuBLASLt-no-split is not verified "
                    f"to give the canonical bits for {a.dtype} K={a.shape[-1]} on {a.device}")
            return True
        return (ok and a.shape[0] >= cublaslt_min_m(n) and aligned_16_bytes(a.shape[-1], n)
                and cublaslt_verified(a.device, a.dtype, a.shape[-1], bias is not None))

    def cublaslt_route(self, a: torch.Tensor, n: int, bias: torch.Tensor | None) -> bool:
        """:meth:`use_cublaslt`, kept by what it depends on: A's shape, N, the dtype, the
        device, the bias's presence, RLKERNELS_GEMM_BACKEND and the batch-invariant mode
        (a probe's verdict is final for the process). Why: working the answer out cost
        3-6 us per call on the H100 hosts, where a cuBLASLt GEMM at M = 128 takes ~15 us of
        GPU time (benchmarks/results/cublaslt_path_ab_h100_session16_*.json)."""
        key = (a.shape, n, a.dtype, a.get_device(), bias is None, env_get("RLKERNELS_GEMM_BACKEND"),
               _mode_state.overrides_installed())
        route = _CUBLASLT_ROUTES.get(key)
        if route is None:
            route = self.use_cublaslt(a, n, bias)  # (a forced backend that cannot run raises: nothing kept)
            if len(_CUBLASLT_ROUTES) >= MAX_CUBLASLT_ROUTES:
                _CUBLASLT_ROUTES.clear()
            _CUBLASLT_ROUTES[key] = route
        return route

    def gemm(self, a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             accumulate: bool = False, rowsum: torch.Tensor | None = None,
             b_transposed: bool = False) -> torch.Tensor:
        """C = A @ B; ``b_transposed``: b is given as B^T [N, K] (an nn.Linear weight),
        so no transposed view is made per call (host time at decode sizes)."""
        # Sizes the auto path keeps on Triton (below cublaslt_min_m) go straight there, before
        # the checks below (host time: a decode-size GEMM takes less on the GPU than its Python).
        if (a.dim() == 2 and a.shape[0] < cublaslt_min_m(b.shape[0] if b_transposed else b.shape[-1])
                and gemm_backend_mode() == "auto"):
            return triton_gemm(a, b, bias=bias, out=out, out_dtype=out_dtype, accumulate=accumulate, rowsum=rowsum,
                               b_transposed=b_transposed)
        # cuBLASLt only for activation-major A. A transposed A is a reduction over
        # tokens (dW): it stays on the Triton chain, whose TOKEN_BLOCK continuation is
        # proven, and needs no cuBLASLt probe per token count.
        plain = (out is None and not accumulate and rowsum is None and a.dim() == 2 and b.dim() == 2
                 and a.stride(-1) == 1 and out_dtype in (None, a.dtype) and a.shape[0] > 0 and a.shape[1] > 0)
        if plain and self.cublaslt_route(a, b.shape[0] if b_transposed else b.shape[1], bias):
            return linear_no_split_k(a, b if b_transposed else b.t(), bias)
        return triton_gemm(a, b, bias=bias, out=out, out_dtype=out_dtype, accumulate=accumulate, rowsum=rowsum,
                           b_transposed=b_transposed)


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
    def forward(ctx, x, weight, bias, weight_nk: bool, out_dtype, engine):  # type: ignore[override]
        K = x.shape[-1]
        x2 = x.reshape(x.shape[:-1].numel(), K)
        b = weight.t() if weight_nk else weight
        y = engine.gemm(x2, b, bias=bias, out_dtype=out_dtype)
        ctx.save_for_backward(x2, weight, bias)
        ctx.weight_nk, ctx.engine, ctx.in_shape = weight_nk, engine, x.shape
        return y.reshape(*x.shape[:-1], b.shape[1])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x2, weight, bias = ctx.saved_tensors
        engine, weight_nk = ctx.engine, ctx.weight_nk
        w_nk = weight if weight_nk else weight.t()  # [N, K] view either way
        N, K = w_nk.shape
        dy = grad_out.reshape(-1, N).to(x2.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = engine.gemm(dy, w_nk).reshape(ctx.in_shape)
        need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if need_w or need_b:
            acc_dt = accumulator_dtype(x2.dtype)
            w_main = main_grad_target("linear", weight, tuple(weight.shape), "weight") if need_w else None
            # The fused row-sum writes the bias chain through a flat pointer: contiguous only.
            b_main = main_grad_target("linear", bias, (N,), "bias", contiguous=True) if need_b else None
            rowsum = (b_main if b_main is not None else torch.zeros(N, dtype=acc_dt, device=dy.device)) if need_b else None
            if need_w and w_main is not None:
                # dW = dY^T @ X: the reduction runs over tokens, ascending, continuing main_grad's chain.
                engine.gemm(dy.t(), x2, out=w_main if weight_nk else w_main.t(), accumulate=True, rowsum=rowsum)
            elif need_w:
                # The same fp32 chain from zero, rounded once to the parameter dtype at the store.
                dw = engine.gemm(dy.t(), x2, out_dtype=weight.dtype, rowsum=rowsum)
                grad_w = dw if weight_nk else dw.t()
            else:
                # dbias alone: the same fused row-sum chain, against a one-column B.
                engine.gemm(dy.t(), x2[:, :1], out_dtype=acc_dt, rowsum=rowsum)
            if need_b and b_main is None:
                grad_b = rowsum.to(bias.dtype)
        return grad_x, grad_w, grad_b, None, None, None


class _MatmulBase(OpImpl):
    op_class = "gemm"
    engine: TorchEngine | TritonEngine

    def forward(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                out_dtype: torch.dtype | None = None, weight_nk: bool = False) -> torch.Tensor:
        return _run("linear" if weight_nk else "matmul", a, b, bias, weight_nk, out_dtype, self.backend)

    def forward_fp32(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                     weight_nk: bool = False) -> torch.Tensor:
        return self.forward(a, b, bias, out_dtype=accumulator_dtype(a.dtype), weight_nk=weight_nk)

    def invariance_case(self, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
        k, n = (96, 80) if device.type == "cpu" else (1024, 512)
        x = torch.randn(33, k, generator=generator).to(device=device, dtype=dtype)
        w = (torch.randn(n, k, generator=generator) / k ** 0.5).to(device=device, dtype=dtype)
        bias = torch.randn(n, generator=generator).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows, w, bias, weight_nk=True)), x


@register("matmul", "triton")
class MatmulTriton(_MatmulBase):
    engine = TritonEngine()


@register("matmul", "torch")
class MatmulTorch(_MatmulBase):
    engine = TorchEngine()


def engine_for(device: torch.device, backend: str | None = None) -> TorchEngine | TritonEngine:
    """The GEMM engine the registry picks for ``device`` (used by other ops' backward)."""
    name, _ = select_backend("matmul", device, backend)
    return implementation("matmul", name).engine  # type: ignore[attr-defined]


def _autocast(*tensors: torch.Tensor | None) -> list[torch.Tensor | None] | tuple[torch.Tensor | None, ...]:
    # is_cuda first: building the device object costs more than the autocast query.
    dev = "cuda" if tensors[0].is_cuda else tensors[0].device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return [t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors]
    return tensors


def _run(op: str, a, b, bias, weight_nk: bool, out_dtype, backend: str | None):
    V.require_tensor(op, "input", a)
    V.require_tensor(op, "weight" if weight_nk else "b", b)
    a, b, bias = _autocast(a, b, bias)
    if not (isinstance(bias, torch.Tensor) or bias is None) or not _obviously_valid(a, b, bias, weight_nk):
        validate_matmul(op, a, b, bias, weight_nk=weight_nk)
    if out_dtype is not None and out_dtype not in V.FLOAT_DTYPES_WITH_FP64:
        want = "torch.float16, torch.bfloat16, torch.float32, torch.float64 or None"
        if not isinstance(out_dtype, torch.dtype):
            hint = f" (write torch.{out_dtype}, not the string)" if isinstance(out_dtype, str) else ""
            raise TypeError(f"rlkernels.{op}: out_dtype must be a torch.dtype ({want}), got {out_dtype!r}{hint}")
        raise ValueError(f"rlkernels.{op}: out_dtype must be one of {want}, got {out_dtype}")
    engine = engine_for(a.device, backend)
    V.refuse_interpreted_bf16(op, engine.name, a)
    if a.dtype == torch.float64 and engine.name == "triton":
        raise ValueError(f"rlkernels.{op}: float64 runs on the torch backend only (RLKERNELS_BACKEND=torch)")
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad)):
        return GemmFunction.apply(a, b, bias, weight_nk, out_dtype, engine)
    # Inference (rollouts, decode): the same engine call without autograd's bookkeeping,
    # which costs more host time than a decode-size GEMM takes on the GPU.
    if a.dim() == 2:
        return engine.gemm(a, b, bias=bias, out_dtype=out_dtype, b_transposed=weight_nk)
    y = engine.gemm(a.reshape(a.shape[:-1].numel(), a.shape[-1]), b, bias=bias, out_dtype=out_dtype,
                    b_transposed=weight_nk)
    return y.reshape(*a.shape[:-1], y.shape[-1])


# Under torch.compile each call is a graph break (a Triton launch through a cached
# launcher and cuBLASLt's flag handling are not traceable). Eager calls skip the
# disable wrapper, which costs a few microseconds of host time per call.
_run_opaque = torch.compiler.disable(_run)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``a @ b + bias``.

    a: [..., K] (bf16/fp16/fp32; fp64 on the torch backend), b: [K, N], bias: [N] or
    None, all one dtype and device; any strides. Returns [..., N] in ``out_dtype``
    (default a.dtype). Each output row is a function of its own input row alone.
    """
    if torch.compiler.is_compiling():
        return _run_opaque("matmul", a, b, bias, False, out_dtype, backend)
    return _run("matmul", a, b, bias, False, out_dtype, backend)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``F.linear``: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    if torch.compiler.is_compiling():
        return _run_opaque("linear", x, weight, bias, True, None, backend)
    return _run("linear", x, weight, bias, True, None, backend)
