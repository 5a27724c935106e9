"""Backend registry: ops by name, one ``nn.Module`` implementation per backend.

Backends:
  * ``triton`` -- Triton kernels; CUDA/ROCm tensors, or CPU tensors when
    ``TRITON_INTERPRET=1`` (the interpreter runs the real kernels on numpy, which is
    how CI exercises kernel logic).
  * ``torch`` -- ascending-chain PyTorch implementation (``rlkernels.gemm.chain``);
    any device, float64 included. It keeps the invariance contract too.

Ops register themselves when ``rlkernels.ops`` is imported (the package's
``__init__`` does it); this module imports no op.

Which ops are registered: an op is registered when its result depends on a reduction
whose order the contract fixes (GEMMs, row sums, attention, the LM head's statistics),
so the Triton and torch implementations are two producers of one specified bit pattern
and ``rlkernels check`` proves each of them invariant. Every registered op does it one
way: :func:`register_backends` makes one :class:`OpImpl` per backend from the op's base
class, each holding its backend's object in ``backend_impl``; the op's public function
and ``OpImpl.forward`` run the op's one forward core. An elementwise launch with no
reduction (rotary, KV-cache writes, SiLU x up) gives the same bits on either path, so
it is not registered: it asks :func:`triton_usable` whether to launch its kernel.

Choice, per call, from the first tensor argument: ``RLKERNELS_BACKEND`` if set,
else ``triton`` on GPUs and ``torch`` elsewhere. A forced backend that cannot run
on the inputs raises :class:`BackendUnavailableError`; nothing falls back silently
to a path that would break the contract. Meta tensors (shapes only, no values) take
the ``torch`` backend whatever is asked: there are no bits to keep, and it gives the
output shapes and dtypes as stock ops do.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ._env import env_get, triton_interpret

BACKENDS = ("triton", "torch")


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run on the given inputs."""


class OpImpl(nn.Module):
    """Base class of every backend implementation of an op.

    An op's base class sets ``op_class`` (its row of ``rlkernels.contract.CONTRACT``,
    the tolerance its float64 comparison is held to) and implements ``forward``
    (native dtype out) and ``forward_fp32`` (the same math, output kept in fp32: the
    ground-truth path) on ``self.backend_impl``; :func:`register_backends` sets
    ``op_name``, ``backend`` and ``backend_impl``.
    """

    op_name: str = ""
    backend: str = ""
    op_class: str = ""
    backend_impl: Any = None  # the backend's object the op's forward core runs on (None: the core takes the name)

    def forward_fp32(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def invariance_case(self, device: torch.device, dtype: torch.dtype,
                        generator: torch.Generator) -> tuple[Callable[[torch.Tensor], Any], torch.Tensor]:
        """A representative call for ``rlkernels check``: (fn of a row batch, the rows).

        Rows are dim 0 of the returned tensor; fn must treat them as independent.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no invariance case")

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """None if this backend can run on ``device``, else why not."""
        return backend_unavailable_reason(cls.backend, device)

    def extra_repr(self) -> str:
        return f"op={self.op_name!r}, backend={self.backend!r}, op_class={self.op_class!r}"


_REGISTRY: dict[str, dict[str, type[OpImpl]]] = {}


def _register(op_name: str, backend: str) -> Callable[[type[OpImpl]], type[OpImpl]]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")

    def deco(cls: type[OpImpl]) -> type[OpImpl]:
        cls.op_name, cls.backend = op_name, backend
        _REGISTRY.setdefault(op_name, {})[backend] = cls
        return cls

    return deco


def register_backends(op_name: str, base: type[OpImpl], impls: dict[str, Any]) -> None:
    """Register ``op_name``: one subclass of ``base`` per backend in ``impls`` (backend name
    -> the object its forward core runs on, or None where the core takes the backend's name)."""
    for backend, impl in impls.items():
        name = base.__name__.lstrip("_") + backend.capitalize()
        _register(op_name, backend)(type(name, (base,), {"backend_impl": impl, "__module__": base.__module__}))


def backend_object(op_name: str, device: torch.device, backend: str | None = None) -> Any:
    """The ``backend_impl`` of the implementation :func:`select_backend` picks for ``op_name``."""
    name, _ = select_backend(op_name, device, backend)
    return _REGISTRY[op_name][name].backend_impl


def registered_ops() -> dict[str, tuple[str, ...]]:
    return {name: tuple(sorted(impls)) for name, impls in sorted(_REGISTRY.items())}


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def backend_unavailable_reason(backend: str, device: torch.device) -> str | None:
    if backend == "torch":
        return None
    if backend == "triton":
        if not _triton_importable():
            return "triton is not installed"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and triton_interpret():
            return None
        return f"triton needs a CUDA/ROCm device (got {device}); set TRITON_INTERPRET=1 to run it on the CPU"
    return f"unknown backend {backend!r}"


def forced_backend() -> str | None:
    value = (env_get("RLKERNELS_BACKEND") or "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise BackendUnavailableError(f"RLKERNELS_BACKEND={value!r}: expected one of {BACKENDS} or 'auto'")
    return value


_SELECTED: dict[tuple, tuple[str, str]] = {}
_TRITON_USABLE: dict[tuple, bool] = {}


def triton_usable(device: torch.device) -> bool:
    """The Triton backend can run on ``device`` and ``RLKERNELS_BACKEND`` does not ask for
    ``torch``: the choice of the elementwise launches that have no registered op, whose
    torch path gives the same bits. Memoized on what it depends on (called per layer)."""
    key = (device.type, env_get("RLKERNELS_BACKEND"), env_get("TRITON_INTERPRET"))
    hit = _TRITON_USABLE.get(key)
    if hit is None:
        hit = _TRITON_USABLE[key] = forced_backend() != "torch" and backend_unavailable_reason("triton", device) is None
    return hit


def select_backend(op_name: str, device: torch.device, backend: str | None = None) -> tuple[str, str]:
    """(backend, reason) for ``op_name`` on ``device``; raises if a forced backend can't run.

    Memoized on everything the answer depends on (the op, the device type, the
    request and the two environment switches), since it runs on every call.
    """
    key = (op_name, device.type, backend, env_get("RLKERNELS_BACKEND"), env_get("TRITON_INTERPRET"))
    hit = _SELECTED.get(key)
    if hit is None:
        hit = _select_backend(op_name, device, backend)
        _SELECTED[key] = hit
    return hit


def _select_backend(op_name: str, device: torch.device, backend: str | None) -> tuple[str, str]:
    if op_name not in _REGISTRY:
        raise KeyError(f"rlkernels: no op named {op_name!r}; registered: {sorted(_REGISTRY)}")
    impls = _REGISTRY[op_name]
    wanted, why = (backend, "requested") if backend else (forced_backend(), "RLKERNELS_BACKEND")
    if wanted is not None:
        if wanted not in impls:
            raise BackendUnavailableError(f"rlkernels.{op_name}: no {wanted!r} implementation ({why})")
    if device.type == "meta" and "torch" in impls:
        # Meta tensors hold no values, so no backend's bits are at stake: the torch backend's
        # ops propagate shapes and dtypes on any device, as stock ops do on meta.
        return "torch", "meta device (shapes only)"
    if wanted is not None:
        reason = impls[wanted].unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailableError(f"rlkernels.{op_name}: backend {wanted!r} ({why}) cannot run: {reason}")
        return wanted, why
    if device.type == "cuda" and "triton" in impls and impls["triton"].unavailable_reason(device) is None:
        return "triton", "CUDA device"
    return "torch", f"{device.type} device" if device.type != "cuda" else "triton unavailable on this GPU"


def implementation(op_name: str, backend: str) -> type[OpImpl]:
    impls = _REGISTRY.get(op_name, {})
    try:
        return impls[backend]
    except KeyError:
        raise BackendUnavailableError(f"rlkernels.{op_name}: no {backend!r} implementation") from None


def _first_device(args: tuple, kwargs: dict) -> torch.device:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


class OpDispatcher(nn.Module):
    """An op whose backend is chosen per call from the inputs' device."""

    def __init__(self, op_name: str) -> None:
        super().__init__()
        self.op_name = op_name
        self._impls = nn.ModuleDict()

    def impl_for(self, device: torch.device) -> OpImpl:
        backend, _ = select_backend(self.op_name, device)
        if backend not in self._impls:
            self._impls[backend] = implementation(self.op_name, backend)()
        return self._impls[backend]  # type: ignore[return-value]

    @property
    def op_class(self) -> str:
        return next(iter(_REGISTRY[self.op_name].values())).op_class

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.impl_for(_first_device(args, kwargs))(*args, **kwargs)

    def forward_fp32(self, *args: Any, **kwargs: Any) -> Any:
        return self.impl_for(_first_device(args, kwargs)).forward_fp32(*args, **kwargs)


def get_op(name: str, backend: str | None = None) -> nn.Module:
    """The op ``name``: a per-call dispatcher, or the implementation of ``backend``.

    A forced backend is checked when called (it raises
    :class:`BackendUnavailableError` if it cannot run on the inputs given).
    """
    if name not in _REGISTRY:
        raise KeyError(f"rlkernels: no op named {name!r}; registered: {sorted(_REGISTRY)}")
    if backend is None:
        return OpDispatcher(name)
    if backend not in BACKENDS:
        raise BackendUnavailableError(f"rlkernels.{name}: unknown backend {backend!r}; expected one of {BACKENDS}")
    impl = implementation(name, backend)()
    return _Checked(impl)


class _Checked(nn.Module):
    """A forced backend: refuses loudly instead of running somewhere it can't."""

    def __init__(self, impl: OpImpl) -> None:
        super().__init__()
        self.impl = impl
        self.op_class = impl.op_class
        self.backend = impl.backend

    def _check(self, args: tuple, kwargs: dict) -> None:
        device = _first_device(args, kwargs)
        reason = self.impl.unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailableError(f"rlkernels.{self.impl.op_name}: backend {self.impl.backend!r} cannot run: {reason}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check(args, kwargs)
        return self.impl(*args, **kwargs)

    def forward_fp32(self, *args: Any, **kwargs: Any) -> Any:
        self._check(args, kwargs)
        return self.impl.forward_fp32(*args, **kwargs)
