"""Launching a compiled Triton kernel again without Triton's per-call binder.

Why: a decode-size GEMM takes 10-50 us on the GPU, and ``kernel[grid](...)`` spent
33-108 us of host Python per call on the H100 hosts we measured (binding and
specializing every argument, hashing a cache key, looking up device and stream),
against 18-20 us for ``F.linear``. Eager decode calls were host-bound, so a kernel
that is faster on the GPU lost on the clock.

How: the first call for a given *specialization key* goes through the normal
``JITFunction`` path, which compiles (or finds) the kernel, launches it and returns
the ``CompiledKernel``; we keep that object. Later calls with the same key call its
launcher directly, with the same arguments in the same order -- the same binary and
the same launch, so the same bits (a GPU test compares the object with what
Triton's own cache returns for many argument variants).

The key is at least as fine as Triton's specialization: the device, the compile
options, every constexpr, each tensor's dtype and 16-byte alignment, and for each
integer whether it is 1, a multiple of 16, or outside int32 -- the properties
Triton specializes integers and pointers on (or, for launchers told which arguments
are tensors, each integer's value, which is finer still). Launch hooks (profilers such as
proton) and ``RLKERNELS_FAST_LAUNCH=0`` (read when rlkernels is imported) take the
normal path every time.

Both the positional ``CompiledKernel.run`` call and the copy of Triton's specialization
rules are private to Triton, so the cached launch is on only for the Triton releases it
was tested with on a GPU (``_versions.FAST_PATHS["triton_launch"]``); with any other
Triton every launch is ``kernel[grid](...)``, and ``rlkernels info`` says so.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any

import torch

from .._env import switch_on, triton_interpret
from .._versions import fast_path
from ..kernels._triton import GluonTensorDescriptor, triton

FAST_LAUNCH_ENV = "RLKERNELS_FAST_LAUNCH"

try:  # Triton >= 3.4 keeps the launch hooks in knobs
    from triton import knobs as _knobs
except Exception:  # pragma: no cover - older or absent Triton
    _knobs = None

try:  # host-built TMA descriptors (gemm.tma)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except Exception:  # pragma: no cover - older or absent Triton
    _TensorDescriptor = ()
# Gluon kernels take Gluon's descriptors (a shared-memory layout on top): keyed alike.
_DESCRIPTOR_TYPES = tuple(t for t in (_TensorDescriptor, GluonTensorDescriptor) if isinstance(t, type))

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1

# Compile options for kernels that reproduce separately rounded operations: no mul+add
# contraction into an FMA (the interpreter has no such option and never contracts).
NO_FP_FUSION: dict[str, Any] = {} if triton_interpret() else {"enable_fp_fusion": False}

# Triton's num_stages on CUDA where ``kernel[grid](...)`` names none; a launcher takes it
# explicitly, and kernels tuned without one keep the binary they were measured with.
DEFAULT_NUM_STAGES = 3


def fast_launch_status() -> tuple[bool, str]:
    """(on, why) for the cached launch: the one decision every CachedLauncher takes at birth."""
    if _knobs is None:
        return False, "Triton without triton.knobs (< 3.4 or absent): launch hooks can't be seen"
    if not switch_on(FAST_LAUNCH_ENV):
        return False, f"{FAST_LAUNCH_ENV}=0"
    if triton_interpret():
        return False, "TRITON_INTERPRET: the interpreter launches"
    return fast_path("triton_launch")


def fast_launch_enabled() -> bool:
    return fast_launch_status()[0]


def _arg_key(arg: Any) -> Any:
    """One argument's part of the key (for tests; calls key all arguments at once)."""
    return _args_key((arg,))[0]


def _desc_key(d: Any) -> tuple:
    # Triton specializes a host TMA descriptor on its element type and block shape
    # (the tile layout is derived from them); its shape and strides are passed as
    # plain integers. Their divisibility and the padding mode are keyed too, which
    # can only make the key finer than Triton's; a Gluon descriptor's layout as well.
    return (d.base.dtype, tuple(d.block_shape), getattr(d, "padding", None), getattr(d, "layout", None),
            tuple(s & 15 == 0 for s in d.shape), tuple(s & 15 == 0 for s in d.strides))


def _args_key(args: tuple) -> tuple:
    # ints: == 1 is compiled in as a constant, % 16 == 0 is a divisibility hint, and
    # outside int32 makes an i64 parameter; tensors: dtype and 16-byte alignment;
    # floats and None are not specialized by value.
    # (A list comprehension: a generator expression cost 20% more host time.)
    return tuple([
        (2 if a == 1 else (a & 15 == 0) | (4 if a < _I32_MIN or a > _I32_MAX else 0)) if type(a) is int
        else (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
        else _desc_key(a) if isinstance(a, _DESCRIPTOR_TYPES)
        else type(a)
        for a in args])


def launch_hooks_active() -> bool:
    """A profiler's launch hook is installed (Triton >= 3.5 keeps an empty HookChain
    when there is none; older versions keep None)."""
    hook = _knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


# A bound on the keys one launcher keeps (value-keyed integers make one key per problem
# shape); past it the dict starts over, and each key's first call takes Triton's path again.
MAX_KEYS = 4096

def _public_raw_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# The current device and raw stream without torch.cuda's Python wrappers (1-2 us of host
# time per call on the H100 hosts), within the torch releases that was run with
# (_versions.FAST_PATHS["torch_cuda_accessors"]); only called once CUDA is initialized.
if fast_path("torch_cuda_accessors")[0] and hasattr(torch._C, "_cuda_getDevice"):
    current_device = torch._C._cuda_getDevice
    current_raw_stream = torch._C._cuda_getCurrentRawStream
else:
    current_device = torch.cuda.current_device
    current_raw_stream = _public_raw_stream


def constexpr_names(fn: Any) -> tuple[str, ...] | None:
    """The constexpr parameters ``fn`` declares, in order (None: not a Triton kernel)."""
    params = getattr(fn, "params", None)  # JITFunction (and Gluon's)
    if params is not None:
        return tuple(p.name for p in params if p.is_constexpr)
    py = getattr(fn, "fn", None)  # the interpreter's InterpretedFunction wraps the Python function
    if py is None:
        return None
    names = []
    for name, param in inspect.signature(py).parameters.items():
        ann = param.annotation  # a string under ``from __future__ import annotations``
        if (ann.rsplit(".", 1)[-1] if isinstance(ann, str) else getattr(ann, "__name__", None)) == "constexpr":
            names.append(name)
    return tuple(names)


def _tuple_getter(names: tuple[str, ...]) -> Any:
    """dict -> tuple of its values in ``names``' order (itemgetter: one C call)."""
    if len(names) == 1:
        name = names[0]
        return lambda d: (d[name],)
    return operator.itemgetter(*names) if names else (lambda d: ())


class CachedLauncher:
    """``launcher(grid, args, constexprs, num_warps=, num_stages=)`` == ``fn[grid](*args, **constexprs, ...)``.

    ``args`` are the kernel's runtime parameters in declaration order; ``constexprs`` a
    dict of its constexpr parameters by name (all of them, no others: a clear error
    names the kernel and what is missing or extra). The launcher reads the declared
    names once and turns the dict into a tuple in declared order with one C call, so
    keys and launches stay positional. A tuple is taken as already in that order: what
    :meth:`ordered` returns, kept by launch plans.

    ``leading_tensors=n``: the caller promises that the first n arguments are always
    tensors. The rest are then keyed by value -- finer than Triton's specialization on
    integers, so never another kernel -- and the key costs a slice instead of a loop
    over every argument (half the key's host time; decode calls are host-bound).

    ``options``: compile options (e.g. ``enable_fp_fusion``) passed to every normal
    launch; fixed for the launcher's life, so the key need not hold them.
    """

    def __init__(self, fn: Any, leading_tensors: int = 0, options: dict[str, Any] | None = None) -> None:
        self.fn = fn
        self.kernels: dict[tuple, Any] = {}
        self.enabled = fast_launch_enabled()
        self.leading_tensors = leading_tensors
        self.options = dict(options or {})
        self.constexpr_names = constexpr_names(fn)
        self._getter = _tuple_getter(self.constexpr_names) if self.constexpr_names is not None else None

    def ordered(self, constexprs: dict[str, Any] | tuple) -> tuple:
        """The constexprs as a tuple in the kernel's declared order, the names checked."""
        if type(constexprs) is not dict:
            return constexprs
        if self._getter is not None and len(constexprs) == len(self.constexpr_names):
            try:
                return self._getter(constexprs)
            except KeyError:
                pass
        raise self._names_error(constexprs)

    def _names_error(self, constexprs: dict[str, Any]) -> TypeError:
        kernel = getattr(self.fn, "__name__", None) or getattr(getattr(self.fn, "fn", None), "__name__", repr(self.fn))
        if self.constexpr_names is None:
            return TypeError(f"{kernel}: constexprs by name need a Triton kernel, whose declared names are known")
        declared = set(self.constexpr_names)
        missing = [n for n in self.constexpr_names if n not in constexprs]
        extra = [n for n in constexprs if n not in declared]
        return TypeError(f"kernel {kernel}: constexprs missing {missing}, unexpected {extra}; "
                         f"it declares {list(self.constexpr_names)}")

    def key(self, args: tuple, constexprs: tuple, num_warps: int, num_stages: int) -> tuple:
        n = self.leading_tensors
        if n:
            return (current_device(), num_warps, num_stages, constexprs, args[n:],
                    tuple([(t.dtype, t.data_ptr() & 15 == 0) for t in args[:n]]))
        return (current_device(), num_warps, num_stages, constexprs, _args_key(args))

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any] | tuple, *, num_warps: int,
                 num_stages: int, stream: int | None = None) -> None:
        """``stream``: the current raw stream, where the caller already has it."""
        if type(constexprs) is dict:
            constexprs = self.ordered(constexprs)
        if not self.enabled or launch_hooks_active():
            self.fn[grid](*args, *constexprs, num_warps=num_warps, num_stages=num_stages, **self.options)
            return
        self._launch(self.key(args, constexprs, num_warps, num_stages), grid, args, constexprs, num_warps,
                     num_stages, stream)

    def launch_keyed(self, key: tuple, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any] | tuple, *,
                     num_warps: int, num_stages: int, stream: int | None = None) -> None:
        """The same launch, with ``key`` (:meth:`key` of these arguments) kept by the caller
        from an earlier call whose arguments differed at most in their tensors, with the
        same dtypes and 16-byte alignment (the launch plans of ``gemm.triton`` and ``gemm.tma``)."""
        if type(constexprs) is dict:
            constexprs = self.ordered(constexprs)
        if not self.enabled or launch_hooks_active():
            self(grid, args, constexprs, num_warps=num_warps, num_stages=num_stages, stream=stream)
            return
        self._launch(key, grid, args, constexprs, num_warps, num_stages, stream)

    def _launch(self, key: tuple, grid: tuple[int, ...], args: tuple, constexprs: tuple, num_warps: int,
                num_stages: int, stream: int | None) -> None:
        kernel = self.kernels.get(key)
        if kernel is None:
            if len(self.kernels) >= MAX_KEYS:
                self.kernels.clear()
            self.kernels[key] = self.fn[grid](*args, *constexprs, num_warps=num_warps, num_stages=num_stages,
                                              **self.options)
            return
        if stream is None:
            stream = current_raw_stream(key[0])
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                   kernel.function, kernel.packed_metadata, None, None, None, *args, *constexprs)


def kept_launch_key(launcher: Any, args: tuple, constexprs: tuple, num_warps: int, num_stages: int) -> tuple | None:
    """The key a launch plan keeps for :meth:`CachedLauncher.launch_keyed`, or None where
    ``launcher`` is not a live CachedLauncher (fast launch off, a benchmark's stand-in):
    :func:`launch_with_key` then calls it normally."""
    return (launcher.key(args, launcher.ordered(constexprs), num_warps, num_stages)
            if isinstance(launcher, CachedLauncher) and launcher.enabled else None)


def launch_with_key(launcher: Any, key: tuple | None, grid: tuple[int, ...], args: tuple, constexprs: tuple, *,
                    num_warps: int, num_stages: int, stream: int | None = None) -> None:
    """``launcher``'s launch, through ``key`` where a plan kept one (:func:`kept_launch_key`)."""
    if key is None:
        launcher(grid, args, constexprs, num_warps=num_warps, num_stages=num_stages, stream=stream)
    else:
        launcher.launch_keyed(key, grid, args, constexprs, num_warps=num_warps, num_stages=num_stages, stream=stream)


def cached_launcher(fn: Any, leading_tensors: int = 0, options: dict[str, Any] | None = None) -> CachedLauncher | None:
    return CachedLauncher(fn, leading_tensors, options) if triton is not None else None
