"""runtime.launcher: the cached launch is Triton's own kernel, launched the same way.

CPU: the specialization key separates every property Triton specializes on.
GPU: for many argument variants the cached kernel *is* the object Triton's cache
returns for those arguments, and the GEMM bits equal the normal launch's.
"""
from __future__ import annotations

import pytest
import torch

from rlkernels.gemm import table as gemm_table

from rlkernels.runtime import launcher as _launch

from rlkernels.gemm import triton as gemm


@pytest.mark.parametrize("a,b", [
    (1, 2),              # 1 is compiled in as a constant
    (16, 17),            # divisibility by 16
    (32, 48 + 1),
    ((1 << 31) - 16, 1 << 31),  # int32 vs int64 parameter (both multiples of 16)
    (-(1 << 31), -(1 << 31) - 16),
])
def test_key_separates_integer_specializations(a, b):
    assert _launch._arg_key(a) != _launch._arg_key(b)


def test_key_separates_tensor_alignment_and_dtype():
    x = torch.randn(64, dtype=torch.float32)
    assert x.data_ptr() % 16 == 0
    assert _launch._arg_key(x) != _launch._arg_key(x[1:])           # 4-byte offset: not 16-byte aligned
    assert _launch._arg_key(x) == _launch._arg_key(x[4:])           # 16-byte offset: aligned
    assert _launch._arg_key(x) != _launch._arg_key(x.to(torch.float16))


@pytest.mark.skipif(not isinstance(_launch._TensorDescriptor, type), reason="this Triton has no host TMA descriptors")
def test_key_separates_descriptor_dtype_block_and_divisibility():
    desc = _launch._TensorDescriptor
    x = torch.randn(64, 64, dtype=torch.float32)
    base = _launch._arg_key(desc(x, [64, 64], [64, 1], [16, 32]))
    assert base == _launch._arg_key(desc(x.clone(), [64, 64], [64, 1], [16, 32]))
    assert base != _launch._arg_key(desc(x.half(), [64, 64], [64, 1], [16, 32]))
    assert base != _launch._arg_key(desc(x, [64, 64], [64, 1], [32, 32]))
    assert base != _launch._arg_key(desc(x, [60, 64], [64, 1], [16, 32]))


def test_key_keeps_bools_and_floats_apart_from_ints():
    assert _launch._arg_key(True) != _launch._arg_key(1)
    assert _launch._arg_key(2.0) == _launch._arg_key(3.5)  # Triton does not specialize floats by value


def test_leading_tensor_key_is_finer_than_the_specialization(monkeypatch):
    monkeypatch.setattr(_launch, "current_device", lambda: 0)  # (CPU: no CUDA device to ask)
    launcher = _launch.CachedLauncher(lambda: None, leading_tensors=2)
    x = torch.randn(64, dtype=torch.float32)

    def key(*args):
        return launcher.key(args, (True,), 4, 3)

    base = key(x, x, 16, 1)
    assert base == key(x.clone(), x[4:], 16, 1)          # other tensors, same dtype and alignment
    assert base != key(x[1:], x, 16, 1)                  # not 16-byte aligned
    assert base != key(x, x.half(), 16, 1)               # dtype
    assert base != key(x, x, 32, 1)                      # integers by value: 16 and 32 specialize
    assert _launch._arg_key(16) == _launch._arg_key(32)  # alike, so the value key is the finer one
    assert base != launcher.key((x, x, 16, 1), (False,), 4, 3)  # constexprs
    assert base != launcher.key((x, x, 16, 1), (True,), 8, 3)   # warps


def test_disabled_by_env_and_interpreter(monkeypatch):
    monkeypatch.setenv(_launch.FAST_LAUNCH_ENV, "0")
    assert not _launch.fast_launch_enabled()
    monkeypatch.setenv(_launch.FAST_LAUNCH_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _launch.fast_launch_enabled()


# ---------------------------------------------------------------------------- GPU

def _gpu_randn(seed: int, *, need_tma: bool = False):
    """``rnd(*shape, dtype=bf16)``: seeded random CUDA tensors (``need_tma``: skip where
    the GPU has no TMA)."""
    if need_tma:
        from rlkernels.gemm import tma as gemm_tma

        probe = torch.zeros(16, 16, device="cuda", dtype=torch.bfloat16)
        if not gemm_tma.tma_eligible(probe, probe, None):
            pytest.skip("no TMA on this GPU")
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    return rnd


def _variants():
    """(a, b, kwargs) covering the specializations: M/N/K of 1, odd and multiples of 16,
    misaligned pointers, transposed operands, bias, accumulate, row sums, batches."""
    rnd = _gpu_randn(seed=3)

    # (Each new specialization compiles: the list is kept to what the key must separate.)
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, n in ((1, 4096, 4096), (2, 512, 256), (17, 1001, 131), (64, 256, 1), (1, 1, 64)):
            a, w = rnd(m, k, dtype=dtype), rnd(n, k, dtype=dtype)
            yield a, w.t(), {}
            yield a, w.t(), {"bias": rnd(n, dtype=dtype)}
            wide = rnd(m, k + 1, dtype=dtype)
            yield wide[:, 1:], w.t(), {}  # a starts 2-4 bytes off: not 16-byte aligned
            yield a, w.t().contiguous(), {}  # b as [K, N] row-major
            yield a, w, {"b_transposed": True}  # the nn.Linear weight as given (rlkernels.linear)
        dy, x = rnd(96, 256, dtype=dtype), rnd(96, 80, dtype=dtype)
        acc = rnd(256, 80, dtype=torch.float32)
        yield dy.t(), x, {"out": acc, "accumulate": True, "rowsum": rnd(256, dtype=torch.float32)}
        yield rnd(5, 12, 64, dtype=dtype), rnd(5, 64, 12, dtype=dtype), {}
        yield rnd(5, 12, 64, dtype=dtype), rnd(64, 12, dtype=dtype), {}


def _clone_kwargs(kwargs):
    return {k: (v.clone() if isinstance(v, torch.Tensor) and k in ("out", "rowsum") else v) for k, v in kwargs.items()}


def _normal_launches(monkeypatch, module, name: str) -> None:
    """``module.name`` launches through Triton's own ``kernel[grid](...)`` path every time
    (a disabled CachedLauncher of the same kernel): the reference the cached launches must match."""
    launcher = _launch.CachedLauncher(getattr(module, name).fn)
    launcher.enabled = False
    monkeypatch.setattr(module, name, launcher)


class _CheckingLauncher(_launch.CachedLauncher):
    """A cached launcher that asserts, on every call, that its kernel is Triton's own."""

    def __init__(self, fn, checked: list, leading_tensors: int = 0, options: dict | None = None) -> None:
        super().__init__(fn, leading_tensors, options)
        self.checked = checked

    def _launch(self, key, grid, args, constexprs, num_warps, num_stages, stream):
        # Every cached launch passes here: through __call__ and through the launch plans.
        super()._launch(key, grid, args, constexprs, num_warps, num_stages, stream)
        assert key == self.key(args, constexprs, num_warps, num_stages)
        ours = self.kernels[key]
        theirs = self.fn.warmup(*args, *constexprs, grid=grid, num_warps=num_warps, num_stages=num_stages,
                                **self.options)
        assert ours is theirs, f"cached kernel differs from Triton's for key {key}"
        self.checked.append(key)


@pytest.mark.gpu
def test_cached_launch_is_tritons_kernel_and_gives_the_same_bits(monkeypatch):
    checked = []
    # Keyed as the production launcher keys (its leading tensors: integers by value).
    launcher = _CheckingLauncher(gemm.gemm_kernel, checked, gemm._launch_gemm.leading_tensors)
    assert launcher.enabled and launcher.leading_tensors == 5
    for a, b, kwargs in _variants():
        normal_kwargs = _clone_kwargs(kwargs)
        _normal_launches(monkeypatch, gemm, "_launch_gemm")
        want = gemm.triton_gemm(a, b, **normal_kwargs)
        monkeypatch.setattr(gemm, "_launch_gemm", launcher)
        monkeypatch.setattr(gemm, "_PLANS", {})
        # The first call compiles through Triton (and makes a launch plan for a 2-D forward);
        # the others are cached launches, from the plan where there is one.
        for _ in range(3):
            kw = _clone_kwargs(kwargs)
            got = gemm.triton_gemm(a, b, **kw)
            assert torch.equal(got, want), (tuple(a.shape), tuple(b.shape), sorted(kwargs))
            if "rowsum" in kwargs:
                assert torch.equal(kw["rowsum"], normal_kwargs["rowsum"])
    assert len(checked) > 60 and len(set(checked)) > 20


@pytest.mark.gpu
def test_cached_tma_launch_is_tritons_kernel_and_gives_the_same_bits(monkeypatch):
    from rlkernels.gemm import tma as gemm_tma

    rnd = _gpu_randn(seed=5, need_tma=True)
    variants = []
    for dtype in (torch.bfloat16, torch.float16):
        for m, k, n in ((300, 4096, 4096), (1031, 1000, 1032), (2048, 512, 2056)):
            a, w = rnd(m, k, dtype=dtype), rnd(n, k, dtype=dtype)
            variants += [(a, w.t(), {}), (a, w.t(), {"bias": rnd(n, dtype=dtype)}), (a, w.t().contiguous(), {})]
        dy, x = rnd(1024, 520, dtype=dtype), rnd(1024, 264, dtype=dtype)  # dW = dY^T X into an fp32 main_grad
        variants.append((dy.t(), x, {"out": rnd(520, 264, dtype=torch.float32), "accumulate": True}))
    configs = [gemm_table.GEMM_ACCUMULATE_16BIT] + [c for c in gemm_table.all_configs(torch.bfloat16) if c.tma]
    checked = []
    for cfg in dict.fromkeys(configs):
        for a, b, kwargs in variants:
            _normal_launches(monkeypatch, gemm_tma, "_launch_tma")
            try:
                want = gemm_tma.tma_gemm(a, b, cfg, **_clone_kwargs(kwargs))
            except gemm.OutOfResources:
                continue  # triton_gemm takes the pointer kernel there (tests/gemm/test_tma.py)
            monkeypatch.setattr(gemm_tma, "_launch_tma", _CheckingLauncher(gemm_tma.gemm_tma_kernel, checked))
            for _ in range(2):  # the first call compiles through Triton, the second is the cached launch
                got = gemm_tma.tma_gemm(a, b, cfg, **_clone_kwargs(kwargs))
                assert torch.equal(got, want), (cfg.short(), tuple(a.shape), tuple(b.shape), sorted(kwargs))
    assert len(checked) > 20 and len(set(checked)) > 8


# The attention launchers and the compile options Triton must have compiled each kernel with.
_ATTN_LAUNCHERS = {"_launch_fwd": False, "_launch_split": False, "_launch_combine": False,
                   "_launch_bwd_delta": True, "_launch_bwd_dkdv": True, "_launch_bwd_dq": True}


@pytest.mark.gpu
def test_cached_attention_launches_are_tritons_kernels_and_give_the_same_bits(monkeypatch):
    from rlkernels.ops import attention as A
    from rlkernels.ops.attention import triton_host

    rnd = _gpu_randn(seed=7)
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for L, d in ((100, 128), (1500, 64)):
            cases.append(("prefill", rnd(2, L, 16, d, dtype=dtype), rnd(2, L, 8, d, dtype=dtype),
                          rnd(2, L, 8, d, dtype=dtype)))
        for cap, lens in ((4096, [1, 900, 3000]), (1000, [1, 999])):  # split + combine; one split (FINISH)
            seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            cases.append(("decode", rnd(len(lens), 1, 16, 128, dtype=dtype), rnd(len(lens), cap, 8, 128, dtype=dtype),
                          rnd(len(lens), cap, 8, 128, dtype=dtype), seqlens))

    def run(case):
        if case[0] == "decode":
            return [A.flash_attn_with_kvcache(case[1], case[2], case[3], cache_seqlens=case[4])]
        q, k, v = (x.detach().requires_grad_() for x in case[1:])
        out = A.flash_attn_func(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        return [out, q.grad, k.grad, v.grad]

    production = {name: getattr(triton_host, name) for name in _ATTN_LAUNCHERS}
    for name, prod in production.items():  # the reference: Triton's own launch path every time
        normal = _launch.CachedLauncher(prod.fn, options=prod.options)
        normal.enabled = False
        monkeypatch.setattr(triton_host, name, normal)
    want = [run(c) for c in cases]
    checked = []
    launchers = {name: _CheckingLauncher(prod.fn, checked, options=prod.options) for name, prod in production.items()}
    for name, launcher in launchers.items():
        monkeypatch.setattr(triton_host, name, launcher)
    for _ in range(2):  # the first call compiles through Triton, the second is the cached launch
        for case, w in zip(cases, want):
            assert all(torch.equal(a, b) for a, b in zip(run(case), w)), case[0]
    for name, fusion in _ATTN_LAUNCHERS.items():
        kernels = list(launchers[name].kernels.values())
        assert kernels and all(k.metadata.enable_fp_fusion is fusion for k in kernels), name
    assert len(checked) > 20


def test_cached_launcher_passes_its_compile_options(monkeypatch):
    """Options given to the launcher reach Triton on the normal path and on each key's first launch."""
    jit_calls = []

    class FakeJitFunction:
        def __getitem__(self, grid):
            return lambda *args, **options: jit_calls.append(options) or object()

    monkeypatch.setattr(_launch, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "launch_hooks_active", lambda: False)
    x = torch.randn(8)
    for enabled in (False, True):
        launcher = _launch.cached_launcher(FakeJitFunction(), options={"enable_fp_fusion": False})
        launcher.enabled = enabled
        launcher((1,), (x, 3), (True,), num_warps=2, num_stages=1)
    assert jit_calls == [{"num_warps": 2, "num_stages": 1, "enable_fp_fusion": False}] * 2
    plain = _launch.CachedLauncher(FakeJitFunction())
    plain.enabled = False
    plain((1,), (x, 3), (True,), num_warps=2, num_stages=1)
    assert jit_calls[-1] == {"num_warps": 2, "num_stages": 1}


@pytest.mark.skipif(_launch._knobs is None, reason="this Triton has no knobs module")
def test_launch_hooks_detected():
    runtime = _launch._knobs.runtime
    before = runtime.launch_enter_hook
    assert not _launch.launch_hooks_active()

    def hook(metadata):
        return None

    try:
        if hasattr(before, "add"):  # Triton >= 3.5: a HookChain
            before.add(hook)
        else:
            runtime.launch_enter_hook = hook
        assert _launch.launch_hooks_active()
    finally:
        if hasattr(before, "remove"):
            before.remove(hook)
        else:
            runtime.launch_enter_hook = before
    assert not _launch.launch_hooks_active()


def test_cached_launcher_compiles_once_per_key_then_calls_the_kernel_directly(monkeypatch):
    """The launch protocol, with stand-ins for Triton's JITFunction and CompiledKernel."""
    jit_calls = []

    class FakeCompiledKernel:
        function, packed_metadata = "cu_function", ("num_warps", "num_ctas", "shared")

        def __init__(self):
            self.launches = []

        def run(self, *launch_args):
            self.launches.append(launch_args)

    kernel = FakeCompiledKernel()

    class FakeJitFunction:
        def __getitem__(self, grid):
            def launch(*args, **options):
                jit_calls.append((grid, args, options))
                return kernel
            return launch

    monkeypatch.setattr(_launch, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "current_raw_stream", lambda device: 4321)
    monkeypatch.setattr(_launch, "launch_hooks_active", lambda: False)
    launcher = _launch.CachedLauncher(FakeJitFunction())
    launcher.enabled = True
    x = torch.randn(8)
    for _ in range(3):
        launcher((6, 2), (x, 5, 32), (True, 64), num_warps=4, num_stages=3)
    assert jit_calls == [((6, 2), (x, 5, 32, True, 64), {"num_warps": 4, "num_stages": 3})]
    # Later calls: grid padded to 3-D, the current stream, no launch metadata or hooks,
    # then every runtime argument and every constexpr in declaration order.
    want = (6, 2, 1, 4321, "cu_function", ("num_warps", "num_ctas", "shared"), None, None, None, x, 5, 32, True, 64)
    assert len(kernel.launches) == 2 and all(len(l) == len(want) for l in kernel.launches)
    assert all(a is b or a == b for l in kernel.launches for a, b in zip(l, want))
    # Another specialization (an integer equal to 1) or other options compile again.
    launcher((6,), (x, 1, 32), (True, 64), num_warps=4, num_stages=3)
    launcher((6, 2), (x, 5, 32), (True, 64), num_warps=8, num_stages=3)
    assert len(jit_calls) == 3 and len(kernel.launches) == 2
    # A stream the caller already has is used as given.
    launcher((6, 2), (x, 5, 32), (True, 64), num_warps=4, num_stages=3, stream=99)
    assert kernel.launches[-1][3] == 99


def test_cached_launcher_key_count_is_bounded(monkeypatch):
    compiled = []

    class FakeJitFunction:
        def __getitem__(self, grid):
            return lambda *args, **options: compiled.append(args) or object()

    monkeypatch.setattr(_launch, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "launch_hooks_active", lambda: False)
    monkeypatch.setattr(_launch, "MAX_KEYS", 8)
    launcher = _launch.CachedLauncher(FakeJitFunction(), leading_tensors=1)
    launcher.enabled = True
    x = torch.randn(8)
    for m in range(20):  # value-keyed integers: one key per M
        launcher((1,), (x, m), (), num_warps=4, num_stages=3)
    assert len(compiled) == 20 and 0 < len(launcher.kernels) <= 8


@pytest.mark.gpu
def test_tma_launch_plans_give_the_full_paths_bits(monkeypatch):
    # 2-D forward calls on the table's TMA tiles (M > 256) launch from gemm.tma's plans
    # after the first: the kernel must be Triton's own for the new arguments (the plan's
    # kept launcher key is checked against them) and the bits those of the full path.
    from rlkernels.gemm import tma as gemm_tma

    rnd = _gpu_randn(seed=11, need_tma=True)

    checked = []
    for dtype in (torch.bfloat16, torch.float16):
        for m, k, n in ((300, 1000, 1032), (1031, 512, 2056), (2049, 256, 520)):
            assert gemm_table.gemm_config(m, n, dtype).tma
            w, bias = rnd(n, k, dtype=dtype), rnd(n, dtype=dtype)
            for b, kwargs in ((w, {"b_transposed": True}), (w, {"b_transposed": True, "bias": bias}),
                              (w.t().contiguous(), {})):
                calls = [rnd(m, k, dtype=dtype) for _ in range(3)]
                _normal_launches(monkeypatch, gemm_tma, "_launch_tma")
                cfg = gemm_table.gemm_config(m, n, dtype)  # an explicit config: the full path, no plan
                wants = [gemm.triton_gemm(x, b, config=cfg, **kwargs) for x in calls]
                monkeypatch.setattr(gemm, "_PLANS", {})
                monkeypatch.setattr(gemm_tma, "_launch_tma", _CheckingLauncher(gemm_tma.gemm_tma_kernel, checked))
                for x, want in zip(calls, wants):
                    assert torch.equal(gemm.triton_gemm(x, b, **kwargs), want), (m, k, n, dtype, sorted(kwargs))
                plans = list(gemm._PLANS.values())
                assert len(plans) == 1 and isinstance(plans[0], gemm_tma.TmaPlan)
    assert len(checked) >= 36


# ---------------------------------------------------------------- constexprs by name

def _production_launchers():
    import importlib

    found = []
    for mod in ("ops.bmm", "ops.linear_logprob", "ops.lm_head.statistics", "ops.lm_head.lse", "ops.linear_sample",
                "ops.attention.triton_host", "ops.attention.ws_host", "ops.norms",
                "gemm.triton", "gemm.tma", "gemm.grouped", "gemm.ktree"):
        m = importlib.import_module(f"rlkernels.{mod}")
        for name, value in vars(m).items():
            for launcher in (value.values() if isinstance(value, dict) else (value,)):
                if isinstance(launcher, _launch.CachedLauncher):
                    found.append((f"{mod}.{name}", launcher))
    return found


def test_every_launcher_knows_its_kernels_constexpr_names():
    launchers = _production_launchers()
    assert len(launchers) >= 20
    for name, launcher in launchers:
        assert launcher.constexpr_names, name
        # The interpreter's wrapper (no ``params``) gives the same names from the signature.
        wrapped = type("Interpreted", (), {"fn": getattr(launcher.fn, "fn", launcher.fn)})()
        assert _launch.constexpr_names(wrapped) == launcher.constexpr_names, name


class _NamedKernel:
    """A JITFunction stand-in: declared parameters, and kernel[grid](...) recorded."""

    class _Param:
        def __init__(self, name, is_constexpr):
            self.name, self.is_constexpr = name, is_constexpr

    __name__ = "named_kernel"

    def __init__(self):
        self.params = [self._Param(n, n.isupper()) for n in ("x_ptr", "n", "HAS_BIAS", "BLOCK", "IEEE")]
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **options: self.calls.append(args) or object()


def test_constexprs_by_name_launch_in_declared_order():
    fn = _NamedKernel()
    launcher = _launch.CachedLauncher(fn)
    assert launcher.constexpr_names == ("HAS_BIAS", "BLOCK", "IEEE")
    launcher.enabled = False
    x = torch.randn(4)
    launcher((1,), (x, 3), dict(IEEE=False, HAS_BIAS=True, BLOCK=64), num_warps=4, num_stages=3)
    launcher((1,), (x, 3), launcher.ordered(dict(BLOCK=64, IEEE=False, HAS_BIAS=True)), num_warps=4, num_stages=3)
    assert [c[2:] for c in fn.calls] == [(True, 64, False)] * 2
    one = _launch.CachedLauncher(type("K", (), {"params": fn.params[:3]})())
    assert one.ordered({"HAS_BIAS": 1}) == (1,)


@pytest.mark.parametrize("constexprs,missing,extra", [
    (dict(HAS_BIAS=True, BLOCK=64), ["IEEE"], []),
    (dict(HAS_BIAS=True, BLOCK=64, IEEE=False, EXTRA=1), [], ["EXTRA"]),
    (dict(HAS_BIAS=True, BLOCK=64, IEE=False), ["IEEE"], ["IEE"]),
])
def test_wrong_constexpr_names_are_refused_by_name(constexprs, missing, extra):
    launcher = _launch.CachedLauncher(_NamedKernel())
    launcher.enabled = False
    with pytest.raises(TypeError) as err:
        launcher((1,), (torch.randn(4), 3), constexprs, num_warps=4, num_stages=3)
    msg = str(err.value)
    assert "named_kernel" in msg and f"missing {missing}" in msg and f"unexpected {extra}" in msg
