"""cuBLASLt with split-K forbidden: a second producer of the canonical K-chain bits.

Stock cuBLAS picks split-K by M, so rows change with the batch size. With
``preferred_blas_library("cublaslt")`` and reduced-precision (split-K) reductions
disallowed, bf16/fp16 results were measured bit-identical to the Triton chain on
H100. That is a property of one library build on one GPU, so it is never assumed:
:func:`cublaslt_verified` compares the two on a probe the first time a
(device, dtype, K, bias) is seen, and a mismatch retires this backend for that key
(logged once). The flags are process-global, so they are set and restored around
each call under a lock, and the call is a ``torch.library`` custom op that
``torch.compile`` keeps opaque.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Iterator

import torch

from .._versions import fast_path
from ..runtime import mode_state as _mode_state
from .triton import triton_gemm

log = logging.getLogger("rlkernels")

_FLAG_LOCK = threading.Lock()
_VERIFIED: dict[tuple, bool] = {}
_VERIFY_LOCK = threading.Lock()

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


class _FlagAccess:
    """Get/set of the process-global flags no_split_k changes, full state included.

    The public getter ``matmul.allow_bf16_reduced_precision_reduction`` returns only
    the first element of the (allow_reduced_precision, allow_splitk) pair, and setting
    that bool back sets allow_splitk to True: a caller who had forbidden split-K
    would find it allowed again after any rlkernels call. The torch._C accessors carry
    the pair (torch >= 2.9) and skip the Python attribute dispatch and parsing, a
    measurable part of a decode call's host time. Without them, or with a torch outside
    the releases they were run with (``_versions.FAST_PATHS["torch_cublas_flags"]``),
    the public API stands in, the pair assembled from its two attributes.
    """

    _DIRECT = ("_get_cublas_allow_bf16_reduced_precision_reduction", "_set_cublas_allow_bf16_reduced_precision_reduction",
               "_get_cublas_allow_fp16_reduced_precision_reduction", "_set_cublas_allow_fp16_reduced_precision_reduction",
               "_get_blas_preferred_backend", "_set_blas_preferred_backend", "_BlasBackend")

    def __init__(self) -> None:
        C = torch._C
        self.direct = (fast_path("torch_cublas_flags")[0] and all(hasattr(C, name) for name in self._DIRECT)
                       and isinstance(C._get_cublas_allow_bf16_reduced_precision_reduction(), tuple))
        if self.direct:
            self.get_library, self.set_library = C._get_blas_preferred_backend, C._set_blas_preferred_backend
            self.cublaslt = C._BlasBackend.Cublaslt
            self.get_pair = {torch.bfloat16: C._get_cublas_allow_bf16_reduced_precision_reduction,
                             torch.float16: C._get_cublas_allow_fp16_reduced_precision_reduction}
            self.set_pair = {torch.bfloat16: C._set_cublas_allow_bf16_reduced_precision_reduction,
                             torch.float16: C._set_cublas_allow_fp16_reduced_precision_reduction}
        else:
            library = torch.backends.cuda.preferred_blas_library  # getter and setter in one
            self.get_library, self.set_library, self.cublaslt = library, library, "cublaslt"
            self.get_pair = {dt: functools.partial(_public_pair, _reduction_flag(dt)) for dt in SUPPORTED_DTYPES}
            self.set_pair = {dt: functools.partial(_set_public_pair, _reduction_flag(dt)) for dt in SUPPORTED_DTYPES}


def _public_pair(name: str) -> tuple[bool, bool]:
    flags = torch.backends.cuda.matmul
    return getattr(flags, name), getattr(flags, name + "_split_k", True)


def _set_public_pair(name: str, allow_reduced_precision: bool, allow_splitk: bool) -> None:
    setattr(torch.backends.cuda.matmul, name, (allow_reduced_precision, allow_splitk))


def _reduction_flag(dtype: torch.dtype) -> str:
    return ("allow_bf16_reduced_precision_reduction" if dtype == torch.bfloat16
            else "allow_fp16_reduced_precision_reduction")


FLAGS = _FlagAccess()


def _forbid_split_k(dtype: torch.dtype) -> tuple:
    """cuBLASLt as the BLAS library, split-K disallowed for ``dtype``; returns what to restore.
    Call with _FLAG_LOCK held."""
    saved = FLAGS.get_library(), FLAGS.get_pair[dtype]()
    FLAGS.set_library(FLAGS.cublaslt)
    try:
        # (allow_reduced_precision, allow_splitk): the pair form exists in torch >= 2.9.
        FLAGS.set_pair[dtype](False, False)
    except BaseException:
        FLAGS.set_library(saved[0])
        raise
    return saved


def _restore(dtype: torch.dtype, saved: tuple) -> None:
    FLAGS.set_pair[dtype](*saved[1])
    FLAGS.set_library(saved[0])


@contextlib.contextmanager
def no_split_k(dtype: torch.dtype) -> Iterator[None]:
    """cuBLASLt as the BLAS library and split-K disallowed for ``dtype``; restored on exit."""
    with _FLAG_LOCK:
        saved = _forbid_split_k(dtype)
        try:
            yield
        finally:
            _restore(dtype, saved)


def linear_no_split_k(x: torch.Tensor, weight_nk: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight_nk[N, K]^T (+ bias) through cuBLASLt, no split-K.

    The eager entry point: the library's own callers run eagerly (the public ops are
    graph breaks under torch.compile), and the custom-op dispatch below would add tens
    of microseconds of host time per call (measured: the eager M = 128 calls were
    host-bound on the H100 host). The flags are handled inline rather than through
    :func:`no_split_k`, whose generator costs about a microsecond per call.
    """
    dtype = x.dtype
    with _FLAG_LOCK:
        saved = _forbid_split_k(dtype)
        try:
            return torch.nn.functional.linear(x, weight_nk, bias)
        finally:
            _restore(dtype, saved)


# The same call as an opaque torch.library op, for code that torch.compile traces.
cublaslt_linear = torch.library.custom_op("rlkernels::cublaslt_linear", mutates_args=())(linear_no_split_k)


@cublaslt_linear.register_fake
def _(x: torch.Tensor, weight_nk: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight_nk.shape[0]))


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    # Queried once per device: asking the driver on every call costs more host time
    # than a decode-size GEMM takes on the GPU.
    return torch.cuda.get_device_name(index)


def cublaslt_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and torch.version.cuda is not None and dtype in SUPPORTED_DTYPES


PROBE_ROWS = (131, 1031)
PROBE_N = 384


def cublaslt_verified(device: torch.device, dtype: torch.dtype, k: int, has_bias: bool) -> bool:
    """True if cuBLASLt-no-split gives the Triton chain's bits for this (device, dtype, K, bias)."""
    if not cublaslt_available(device, dtype):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, _device_name(index), dtype, k, has_bias)
    hit = _VERIFIED.get(key)
    if hit is not None:
        return hit
    # The probe compares real cuBLASLt (F.linear) with the Triton chain. While the
    # batch-invariant mode is on, F.linear is itself the Triton chain, so no verdict
    # can be reached: answer "not verified" for now (the Triton chain gives the same
    # bits) and probe on a later call. Holding the mode's lock keeps any thread from
    # turning the mode on mid-probe.
    with _VERIFY_LOCK, _mode_state.LOCK:
        if _mode_state.overrides_installed():
            return False
        if key not in _VERIFIED:
            _VERIFIED[key] = _probe(device, dtype, k, has_bias)
            if not _VERIFIED[key]:
                log.warning("rlkernels: cuBLASLt without split-K does not reproduce the canonical K-chain "
                            "on %s for %s K=%d bias=%s; using the Triton GEMM for it", key[1], dtype, k, has_bias)
    return _VERIFIED[key]


def _probe(device: torch.device, dtype: torch.dtype, k: int, has_bias: bool) -> bool:
    return _probe_bits(device, dtype, k, has_bias, triton_gemm)


def _probe_bits(device: torch.device, dtype: torch.dtype, k: int, has_bias: bool, triton_gemm) -> bool:
    gen = torch.Generator(device=device).manual_seed(1234 + k)
    w = torch.randn(PROBE_N, k, device=device, generator=gen).to(dtype)
    bias = torch.randn(PROBE_N, device=device, generator=gen).to(dtype) if has_bias else None
    for m in PROBE_ROWS:
        x = torch.randn(m, k, device=device, generator=gen).to(dtype)
        if not torch.equal(cublaslt_linear(x, w, bias), triton_gemm(x, w.t(), bias=bias)):
            return False
    return True


def verification_report() -> dict[str, bool]:
    """What has been verified in this process (for ``rlkernels info``)."""
    return {f"{name} {str(dt).replace('torch.', '')} K={k} bias={b}": ok for (_, name, dt, k, b), ok in _VERIFIED.items()}
