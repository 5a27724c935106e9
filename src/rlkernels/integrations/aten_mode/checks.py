"""Stock ATen's argument checks, for the batch-invariant mode's overrides.

An override replaces an ATen kernel, so it also replaces the checks that kernel
made. Each function here raises what stock PyTorch raises for the same
arguments (the same exception type, a message at least as clear) and returns
quietly for everything stock accepts, so the mode never computes a result where
stock raises and never refuses what stock runs. Only host-side metadata is read
(shapes, dtypes, devices): no kernel is launched.

Kernel-level dtype support differs by device (CPU BLAS multiplies integers,
CUDA's does not); :func:`require_kernel_dtype` raises stock's
``NotImplementedError`` wording for the combinations stock has no kernel for.
"""
from __future__ import annotations

from typing import Sequence

import torch

# c10 ScalarType names, as stock's "not implemented for 'Long'" messages spell them.
_SCALAR_NAMES = {
    torch.bool: "Bool", torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
    torch.int64: "Long", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
    torch.float64: "Double", torch.complex32: "ComplexHalf", torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def scalar_name(dtype: torch.dtype) -> str:
    return _SCALAR_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(s) for s in t.shape)


def require_same_device(*tensors: torch.Tensor) -> None:
    devices = []
    for t in tensors:
        if t.device not in devices:
            devices.append(t.device)
    if len(devices) > 1:
        raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                           f"{devices[0]} and {devices[1]}!")


def require_kernel_dtype(kernel: str, t: torch.Tensor, supported: Sequence[torch.dtype]) -> None:
    """Stock's dispatch error for a dtype its kernel has no implementation for."""
    if t.dtype not in supported:
        raise NotImplementedError(f'"{kernel}" not implemented for \'{scalar_name(t.dtype)}\'')


def gemm_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """The dtypes stock's mm/addmm/bmm/baddbmm kernels run on this device."""
    if device.type == "cpu":
        return FLOAT_DTYPES + INTEGER_DTYPES + COMPLEX_DTYPES
    return FLOAT_DTYPES + COMPLEX_DTYPES


def gemm_kernel_name(device: torch.device, batched: bool) -> str:
    if device.type == "cpu":
        return "bmm" if batched else "addmm_impl_cpu_"
    return "bmm_cuda" if batched else "addmm_cuda"


def _require_expandable(what: torch.Tensor, target: Sequence[int]) -> None:
    """``what`` broadcasts to ``target`` (stock's ``expand`` message otherwise)."""
    if what.dim() > len(target):
        raise RuntimeError(f"The expanded size of the tensor ({len(target)}) must be greater or equal to the number "
                           f"of dimensions in the tensor ({what.dim()})")
    offset = len(target) - what.dim()
    for i, size in enumerate(what.shape):
        want = target[offset + i]
        if size != 1 and size != want:
            raise RuntimeError(f"The expanded size of the tensor ({want}) must match the existing size ({size}) at "
                               f"non-singleton dimension {offset + i}.  Target sizes: {list(target)}.  "
                               f"Tensor sizes: {list(what.shape)}")


def check_mm(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2:
        raise RuntimeError("self must be a matrix")
    if b.dim() != 2:
        raise RuntimeError("mat2 must be a matrix")
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({_shape(a)} and {_shape(b)})")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
    require_same_device(a, b)
    require_kernel_dtype(gemm_kernel_name(a.device, False), a, gemm_dtypes(a.device))


def check_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    check_mm(a, b)
    if bias.dtype != a.dtype:
        raise RuntimeError(f"self and mat2 must have the same dtype, but got {bias.dtype} and {a.dtype}")
    require_same_device(bias, a)
    _require_expandable(bias, (a.shape[0], b.shape[1]))


def check_bmm(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 3:
        raise RuntimeError("batch1 must be a 3D tensor")
    if b.dim() != 3:
        raise RuntimeError("batch2 must be a 3D tensor")
    if b.shape[0] != a.shape[0] or b.shape[1] != a.shape[2]:
        raise RuntimeError("Expected size for first two dimensions of batch2 tensor to be: "
                           f"[{a.shape[0]}, {a.shape[2]}] but got: [{b.shape[0]}, {b.shape[1]}].")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected scalar type {a.dtype} but found {b.dtype}")
    require_same_device(a, b)
    require_kernel_dtype(gemm_kernel_name(a.device, True), a, gemm_dtypes(a.device))


def check_baddbmm(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    check_bmm(a, b)
    if base.dtype != a.dtype:
        raise RuntimeError(f"Input dtypes must be the same, got: input {base.dtype}, batch1: {a.dtype}, "
                           f"batch2: {b.dtype}")
    require_same_device(base, a)
    _require_expandable(base, (a.shape[0], a.shape[1], b.shape[2]))


def check_mv(a: torch.Tensor, v: torch.Tensor) -> None:
    if a.dim() != 2 or v.dim() != 1:
        raise RuntimeError(f"vector + matrix @ vector expected, got {a.dim()}, {v.dim()}")
    if a.shape[1] != v.shape[0]:
        raise RuntimeError(f"size mismatch, got input ({a.shape[0]}), mat ({_shape(a)}), vec ({v.shape[0]})")
    if a.dtype != v.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {v.dtype}")
    require_same_device(a, v)
    require_kernel_dtype(gemm_kernel_name(a.device, False), a, gemm_dtypes(a.device))


def check_addmv(base: torch.Tensor, a: torch.Tensor, v: torch.Tensor) -> None:
    check_mv(a, v)
    if base.dtype != a.dtype:
        raise RuntimeError(f"self and mat2 must have the same dtype, but got {base.dtype} and {a.dtype}")
    require_same_device(base, a)
    _require_expandable(base, (a.shape[0],))


def check_dot(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 1 or b.dim() != 1:
        raise RuntimeError(f"1D tensors expected, but got {a.dim()}D and {b.dim()}D tensors")
    if a.dtype != b.dtype:
        raise RuntimeError("dot : expected both vectors to have same dtype, but found "
                           f"{scalar_name(a.dtype)} and {scalar_name(b.dtype)}")
    if a.shape[0] != b.shape[0]:
        raise RuntimeError("inconsistent tensor size, expected tensor [{0}] and src [{1}] to have the same number of "
                           "elements, but got {0} and {1} elements respectively".format(a.shape[0], b.shape[0]))
    require_same_device(a, b)
    require_kernel_dtype("dot", a, gemm_dtypes(a.device))


def wrap_dim(dim: int, ndim: int) -> int:
    """``dim`` in [0, ndim) (a 0-dim tensor takes -1 and 0), or stock's IndexError."""
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {dim})")
    return dim % rank


def check_softmax(x: torch.Tensor, dim: int, half_to_float: bool, log: bool) -> None:
    wrap_dim(dim, x.dim())
    name = ("log_softmax" if log else "softmax") + "_lastdim_kernel_impl"
    if half_to_float:
        if x.device.type == "cpu":
            raise RuntimeError(f"{'log_' if log else ''}softmax with half to float conversion is not supported on CPU")
        if x.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("conversion is supported for Half type only")
    require_kernel_dtype(name, x, FLOAT_DTYPES)


def check_softmax_backward(grad: torch.Tensor, out: torch.Tensor, dim: int) -> None:
    if grad.shape != out.shape:
        raise RuntimeError("Expected tensor for argument #1 'grad_output' to have same size as tensor for argument "
                           f"#2 'output'; but {list(grad.shape)} does not equal {list(out.shape)}")
    require_same_device(grad, out)
    wrap_dim(dim, out.dim())
    require_kernel_dtype("softmax_backward_data", out, FLOAT_DTYPES)


def mean_dims(x: torch.Tensor, dim: Sequence[int] | None) -> list[int]:
    """The reduced dims, wrapped and checked (every dim for None or an empty list, as stock does)."""
    if dim is None or len(dim) == 0:
        return list(range(x.dim()))
    seen: list[int] = []
    for d in dim:
        w = wrap_dim(d, x.dim())
        if w in seen:
            raise RuntimeError(f"dim {w} appears multiple times in the list of dims")
        seen.append(w)
    return sorted(seen) if x.dim() else []


def check_mean(x: torch.Tensor, dtype: torch.dtype | None) -> None:
    if dtype is None and not (x.is_floating_point() or x.is_complex()):
        raise RuntimeError("mean(): could not infer output dtype. Input dtype must be either a floating point or "
                           f"complex dtype. Got: {scalar_name(x.dtype)}")
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError("mean(): could not infer output dtype. Optional dtype must be either a floating point or "
                           f"complex dtype. Got: {scalar_name(dtype)}")


def check_elementwise_float(kernel: str, *tensors: torch.Tensor) -> None:
    require_same_device(*tensors)
    for t in tensors:
        require_kernel_dtype(kernel, t, FLOAT_DTYPES)
