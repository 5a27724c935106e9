"""bmm: tiny-matrix batched GEMM (torch backend, Triton interpreter, and GPU tests)."""
from __future__ import annotations

import pytest
import torch

import rlkernels.ops.bmm as bmm_mod
from rlkernels import contract, reference, testing
from rlkernels.ops.bmm import TINY_TABLE, TinyConfig, bmm, tiny_config
from rlkernels.registry import get_op
from rlkernels._env import triton_interpret

from ..conftest import cpu_backend_cases, interpreter_only, randn

# Local tolerances (rel. Frobenius error vs float64) until contract.py gets a
# "bmm" entry; measured worst cases are in docs/operators/bmm.md.
TOL = {dt: t.tolerance for dt, t in contract.CONTRACT["bmm"].items()}
GRAD_TOL = {dt: t.tolerance for dt, t in contract.CONTRACT["bmm_grad"].items()}
# dB of a shared b is one sequential fp32 chain over B*m terms (65536 at the GPU
# benchmark shapes): its fp32 error grows like sqrt(B*m) (measured 2.3e-6 at 16384).
SHARED_DB_TOL = {**GRAD_TOL, torch.float32: 3e-5}

# (B, m, n, k): the benchmark shapes, at the benchmark B (GPU) and at small B (CPU).
BENCH_SHAPES = [(1024, 12, 12, 64), (1024, 12, 64, 12), (4096, 16, 16, 16), (256, 64, 64, 64), (8192, 8, 8, 32)]
# Small B still spans partial groups: 11 is not a multiple of any group size.
CPU_B = 11
ODD_SHAPES = [(1, 1, 1), (3, 17, 12), (17, 3, 64), (12, 64, 3), (64, 1, 17), (1, 12, 64), (17, 17, 17),
              (64, 64, 1), (3, 3, 3), (17, 5, 33)]



def _operands(B, m, n, k, dtype, gen, *, shared_b=False, device="cpu"):
    a = randn(B, m, k, dtype=dtype, generator=gen, device=device)
    b_shape = (k, n) if shared_b else (B, k, n)
    b = randn(*b_shape, dtype=dtype, generator=gen, device=device, scale=k ** -0.5)
    return a, b


def _check_accuracy(out, a, b, dtype):
    B, m, _ = a.shape
    assert out.dtype == dtype and out.shape == (B, m, b.shape[-1])
    err = testing.rel_error(out, reference.bmm_ref(a, b))
    assert err <= TOL[dtype], f"rel error {err:.3e} > {TOL[dtype]:.1e}"
    return err


# ----------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("backend,dtype", cpu_backend_cases())
@pytest.mark.parametrize("shape", BENCH_SHAPES, ids=lambda s: "x".join(map(str, s[1:])))
@pytest.mark.parametrize("shared_b", [False, True], ids=["batched_b", "shared_b"])
def test_bench_shapes_small_batch(backend, dtype, shape, shared_b, gen):
    _, m, n, k = shape
    a, b = _operands(CPU_B, m, n, k, dtype, gen, shared_b=shared_b)
    out = bmm(a, b, backend=backend)
    _check_accuracy(out, a, b, dtype)
    out32 = get_op("bmm", backend).forward_fp32(a, b)
    assert out32.dtype == torch.float32
    assert torch.equal(out32.to(dtype), out)  # the native output is the fp32 chain rounded once


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
@pytest.mark.parametrize("m,n,k", ODD_SHAPES, ids=lambda v: str(v))
def test_odd_shapes(backend, dtype, m, n, k, gen):
    a, b = _operands(5, m, n, k, dtype, gen)
    _check_accuracy(bmm(a, b, backend=backend), a, b, dtype)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_shared_b_equals_expanded_b(backend, dtype, gen):
    a, b = _operands(6, 12, 17, 33, dtype, gen, shared_b=True)
    shared = bmm(a, b, backend=backend)
    _check_accuracy(shared, a, b, dtype)
    assert torch.equal(shared, bmm(a, b.expand(6, *b.shape), backend=backend))
    assert torch.equal(shared, bmm(a, b.expand(6, *b.shape).contiguous(), backend=backend))


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_strided_operands(backend, dtype, gen):
    a, b = _operands(4, 12, 12, 20, dtype, gen)
    at = a.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major elements
    bt = b.transpose(1, 2).contiguous().transpose(1, 2)
    want = bmm(a, b, backend=backend)
    assert torch.equal(bmm(at, bt, backend=backend), want)
    assert torch.equal(bmm(a[::2], b[::2], backend=backend), want[::2])


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_batch_one_and_empty(backend, dtype, gen):
    a, b = _operands(4, 12, 12, 64, dtype, gen)
    full = bmm(a, b, backend=backend)
    assert torch.equal(bmm(a[:1], b[:1], backend=backend), full[:1])  # B=1 takes the same kernel
    assert bmm(a[:0], b[:0], backend=backend).shape == (0, 12, 12)
    assert bmm(a[:0], b[0], backend=backend).shape == (0, 12, 12)
    assert bmm(a[:, :0], b, backend=backend).shape == (4, 0, 12)
    zero_k = bmm(randn(3, 5, 0, dtype=dtype), randn(3, 0, 4, dtype=dtype), backend=backend)
    assert torch.equal(zero_k, torch.zeros(3, 5, 4, dtype=dtype))


# ----------------------------------------------------------------------------- general path

@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
@pytest.mark.parametrize("m,n,k", [(3, 65, 7), (5, 70, 12), (2, 8, 130)])
def test_general_path_large_dims(backend, dtype, m, n, k, gen):
    # (the interpreter runs the general kernel one row per program: keep m small)
    a, b = _operands(3, m, n, k, dtype, gen)
    _check_accuracy(bmm(a, b, backend=backend), a, b, dtype)
    a2, b2 = _operands(2, m, n, k, dtype, gen, shared_b=True)
    _check_accuracy(bmm(a2, b2, backend=backend), a2, b2, dtype)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_disable_tiny_env_uses_general_path(dtype, gen, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("tiny kernel launched although RLKERNELS_DISABLE_TINY_GEMM=1")

    monkeypatch.setenv("RLKERNELS_DISABLE_TINY_GEMM", "1")
    monkeypatch.setattr(bmm_mod, "_launch_tiny", must_not_run)
    a, b = _operands(5, 3, 12, 64, dtype, gen)
    out = bmm(a, b, backend="triton")
    _check_accuracy(out, a, b, dtype)
    testing.assert_batch_invariant(lambda x: bmm(x, b[0], backend="triton"), a, sizes=[1, 3])


@interpreter_only
def test_launch_failure_raises_without_fallback(gen, monkeypatch):
    # Whether a launch fails is not a function of (m, n, k, dtype) alone, so a fallback
    # could split one shape's elements between two kernels: the error goes to the caller.
    def broken(*args, **kwargs):
        raise RuntimeError("simulated launch failure")

    def must_not_run(*args, **kwargs):
        raise AssertionError("the general path must not stand in for a failed tiny launch")

    a, b = _operands(6, 3, 12, 64, torch.float32, gen)
    monkeypatch.setattr(bmm_mod, "_launch_tiny", broken)
    monkeypatch.setattr(bmm_mod, "_general_triton", must_not_run)
    for _ in range(2):  # and again: nothing is remembered
        with pytest.raises(RuntimeError, match="simulated launch failure"):
            bmm(a, b, backend="triton")


# ----------------------------------------------------------------------------- invariance

def _packed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows = batch elements carrying both operands, so the kit can slice them together."""
    return torch.cat([a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)], dim=1)


def _packed_fn(m: int, n: int, k: int, backend: str):
    def fn(rows: torch.Tensor) -> torch.Tensor:
        a = rows[:, :m * k].reshape(-1, m, k)
        b = rows[:, m * k:].reshape(-1, k, n)
        return bmm(a, b, backend=backend)
    return fn


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
@pytest.mark.parametrize("m,n,k", [(12, 12, 64), (16, 16, 16), (8, 8, 32), (3, 17, 5)])
def test_invariance_kit(backend, dtype, m, n, k, gen):
    rows = 20
    a, b = _operands(rows, m, n, k, dtype, gen)
    fn = _packed_fn(m, n, k, backend)
    x = _packed(a, b)
    testing.assert_batch_invariant(fn, x, sizes=[1, 2, 3, 7, 9, 17])
    testing.assert_chunk_invariant(fn, x, chunks=[5, 1, 9, 5])
    testing.assert_padding_invariant(fn, x[:9], before=3, after=6)
    testing.assert_order_invariant(fn, x)
    shared = b[0]
    fn_shared = lambda rows_a: bmm(rows_a, shared, backend=backend)  # noqa: E731
    testing.assert_batch_invariant(fn_shared, a, sizes=[1, 5, 13])
    testing.assert_padding_invariant(fn_shared, a[:7], before=5, after=2)
    testing.assert_order_invariant(fn_shared, a)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_deterministic(backend, dtype, monkeypatch):
    monkeypatch.setenv("RLKERNELS_BACKEND", backend)
    a = randn(9, 12, 64, generator=torch.Generator().manual_seed(5))
    # A fresh process costs ~10 s (torch + triton imports): one backend per run checks it.
    cross_process = backend == ("triton" if triton_interpret() else "torch")
    testing.assert_deterministic(_fixed_b_bmm, a, runs=3, processes=1 if cross_process else 0)


def _fixed_b_bmm(a: torch.Tensor) -> torch.Tensor:
    b = randn(a.shape[2], 12, generator=torch.Generator().manual_seed(11))
    return bmm(a, b)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_config_choice_is_bitwise_neutral_within_a_mode(dtype, gen):
    # Every element runs the same instructions whatever the group size, so G and
    # warps may change with the table without changing a single bit.
    a, b = _operands(9, 12, 12, 40, dtype, gen)
    modes = (True, False) if dtype == torch.float32 else (True,)
    for use_dot in modes:
        outs = [bmm_mod._triton_bmm(a, b, dtype, config=TinyConfig(g, w, use_dot))
                for g, w in ((1, 4), (2, 1), (4, 4), (16, 2))]
        for o in outs:
            _check_accuracy(o, a, b, dtype)
            assert torch.equal(o, outs[0])


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2])
def test_persistent_configs_give_the_same_bits(dtype, group, gen):
    # The interpreter reports 4 SMs, so 1 program per SM walks 9 elements in several
    # steps (with a partial last group for G = 2) and 16 per SM leaves programs idle.
    a, b = _operands(9, 12, 12, 40, dtype, gen)
    want = bmm_mod._triton_bmm(a, b, dtype, config=TinyConfig(group, 1, True))
    for per_sm, stages in ((1, 1), (1, 3), (16, 2)):
        cfg = TinyConfig(group, 1, True, per_sm, stages)
        assert cfg.persistent and cfg.short().endswith(f"/p{per_sm}s{stages}")
        got = bmm_mod._triton_bmm(a, b, dtype, config=cfg)
        _check_accuracy(got, a, b, dtype)
        assert torch.equal(got, want), cfg.short()
    # A persistent table entry keeps the batch invariance of the one-program-per-group kernel.
    cfg = TinyConfig(group, 1, True, 1, 2)
    testing.assert_batch_invariant(lambda x: bmm_mod._triton_bmm(x, b[0], dtype, config=cfg), a, sizes=[1, 5, 8])


def test_config_table_is_well_formed():
    for (m, n, k, dtype), cfg in TINY_TABLE.items():
        assert max(m, n, k) <= bmm_mod.TINY_MAX_DIM
        assert cfg.group >= 1 and cfg.group & (cfg.group - 1) == 0
        assert cfg.use_dot or dtype == torch.float32  # 16-bit must use the tensor-core chain
        assert tiny_config(m, n, k, dtype) == cfg
    for m in (1, 3, 12, 17, 64):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            cfg = tiny_config(m, 64 - m + 1, 33, dtype)
            assert cfg.use_dot or dtype == torch.float32
            assert cfg == tiny_config(m, 64 - m + 1, 33, dtype)  # pure


@pytest.mark.slow  # ~800K configs: some seconds
def test_config_rule_gives_blocks_the_kernel_takes():
    # Every (m, n, k <= 64, dtype) the tiny path serves gets a config the kernel compiles:
    # tl.arange takes power-of-two lengths only (the group, and every block but the FMA
    # mode's BLOCK_K, which is k itself and only a static_range count), and tl.dot wants
    # >= 16 per dim (fp32 rows: any power of two from Triton 3.5). 17 x 5 x 33 fp32 once
    # got G = 3 and failed to compile.
    from rlkernels.kernels._triton import DOT_ANY_M

    def pow2(x):
        return x >= 1 and x & (x - 1) == 0

    tabled = {key[:3] for key in TINY_TABLE}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        seen = {}
        for m in range(1, bmm_mod.TINY_MAX_DIM + 1):
            for n in range(1, bmm_mod.TINY_MAX_DIM + 1):
                for k in range(1, bmm_mod.TINY_MAX_DIM + 1):
                    cfg = tiny_config(m, n, k, dtype)
                    key = (cfg, bmm_mod.tiny_blocks(m, n, k, cfg, dtype), (m, n, k) in tabled)
                    if key in seen:
                        continue
                    seen[key] = (m, n, k)
                    (bm, bn, bk), in_table = key[1], key[2]
                    assert pow2(cfg.group) and cfg.group <= 16 and pow2(cfg.num_warps), (m, n, k, dtype, cfg)
                    assert bm >= m and bn >= n and bk >= k and pow2(bm) and pow2(bn), (m, n, k, dtype, cfg)
                    if cfg.use_dot:
                        assert pow2(bk) and bn >= 16 and bk >= 16, (m, n, k, dtype, cfg)
                        assert bm >= 16 or (dtype == torch.float32 and DOT_ANY_M), (m, n, k, dtype, cfg)
                    else:
                        assert dtype == torch.float32 and bk == k, (m, n, k, dtype, cfg)
                    if not in_table:
                        # The rule's group is the largest power of two <= its quotient, so
                        # every shape whose quotient was one already keeps its config (and bits).
                        probe = bmm_mod.tiny_blocks(m, n, k, TinyConfig(1, 4, cfg.use_dot), dtype)
                        tile = max(probe[0] * probe[2], probe[2] * probe[1], probe[0] * probe[1])
                        quotient = max(1, min(16, 4096 // tile))
                        assert cfg.group <= quotient < 2 * cfg.group, (m, n, k, dtype, cfg)
    assert tiny_config(17, 5, 33, torch.float32).group == 2


# ----------------------------------------------------------------------------- autograd

def _grads_ref(a, b, grad):
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    reference.bmm_ref(a64, b64).backward(grad.double())
    return a64.grad, b64.grad


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
@pytest.mark.parametrize("shared_b", [False, True], ids=["batched_b", "shared_b"])
@pytest.mark.parametrize("m,n,k", [(12, 12, 64), (8, 8, 32), (3, 17, 5), (4, 65, 6)])
def test_autograd_vs_fp64(backend, dtype, shared_b, m, n, k, gen):
    # (4, 65, 6): forward and dA take the general path, dB (6 x 65) too.
    a, b = _operands(6 if max(m, n, k) <= 64 else 3, m, n, k, dtype, gen, shared_b=shared_b)
    a.requires_grad_()
    b.requires_grad_()
    out = bmm(a, b, backend=backend)
    grad = randn(*out.shape, dtype=dtype, generator=gen)
    out.backward(grad)
    ga, gb = _grads_ref(a, b, grad)
    assert a.grad.dtype == dtype and b.grad.dtype == dtype and b.grad.shape == b.shape
    db_tol = SHARED_DB_TOL if shared_b else GRAD_TOL
    for got, want, what, tol in ((a.grad, ga, "dA", GRAD_TOL), (b.grad, gb, "dB", db_tol)):
        err = testing.rel_error(got, want)
        assert err <= tol[dtype], f"{what} rel error {err:.3e}"
    # per-element gradients are batch-invariant too (dA always; dB for a batched b)
    a2 = a.detach()[:2].clone().requires_grad_()
    b2 = (b.detach() if shared_b else b.detach()[:2]).clone().requires_grad_()
    bmm(a2, b2, backend=backend).backward(grad[:2])
    assert torch.equal(a2.grad, a.grad[:2])
    if not shared_b:
        assert torch.equal(b2.grad, b.grad[:2])


def test_autograd_fp64_gradcheck():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    b3 = torch.randn(3, 5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y: bmm(x, y, backend="torch"), (a, b))
    assert torch.autograd.gradcheck(lambda x, y: bmm(x, y, backend="torch"), (a, b3))


# ----------------------------------------------------------------------------- bad input

def test_bad_input_errors():
    a, b = torch.randn(2, 4, 8), torch.randn(2, 8, 3)
    with pytest.raises(ValueError, match=r"rlkernels.bmm: inner dimensions differ.*k=8.*k=9"):
        bmm(a, torch.randn(2, 9, 3))
    with pytest.raises(ValueError, match=r"rlkernels.bmm: batch sizes differ"):
        bmm(a, torch.randn(3, 8, 3))
    with pytest.raises(ValueError, match=r"rlkernels.bmm: a must have 3 dims"):
        bmm(torch.randn(4, 8), b)
    with pytest.raises(ValueError, match=r"rlkernels.bmm: b must have 2..3 dims"):
        bmm(a, torch.randn(1, 2, 8, 3))
    with pytest.raises(ValueError, match=r"rlkernels.bmm: tensors must share one dtype"):
        bmm(a, b.half())
    with pytest.raises(ValueError, match=r"rlkernels.bmm: a has dtype torch.int64"):
        bmm(a.long(), b.long())
    with pytest.raises(ValueError, match=r"rlkernels.bmm: b has dtype torch.int32"):
        bmm(a, b.int())
    with pytest.raises(ValueError, match=r"rlkernels.bmm: all tensors must be on one device"):
        bmm(a, b.to("meta"))
    with pytest.raises(TypeError, match=r"rlkernels.bmm: a must be a torch.Tensor"):
        bmm([[[1.0]]], b)


@interpreter_only
def test_fp64_refused_on_triton():
    with pytest.raises(ValueError, match=r"rlkernels.bmm: float64 runs on the torch backend only"):
        bmm(torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64), backend="triton")


# ----------------------------------------------------------------------------- GPU

GPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def gpu_bench_case(test):
    """A GPU test run for every benchmark shape and dtype (args ``dtype``, ``shape``)."""
    test = pytest.mark.parametrize("shape", BENCH_SHAPES, ids=lambda s: "x".join(map(str, s)))(test)
    test = pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: str(d)[6:])(test)
    return pytest.mark.gpu(test)


@gpu_bench_case
def test_gpu_bench_shapes(dtype, shape, gen):
    B, m, n, k = shape
    for shared_b in (False, True):
        a, b = _operands(B, m, n, k, dtype, gen, shared_b=shared_b, device="cuda")
        out = bmm(a, b)
        _check_accuracy(out, a, b, dtype)
        assert torch.equal(out, bmm(a, b))  # run to run
        # Invariance: prefixes, a padded batch, a permutation, B=1.
        fn = (lambda x: bmm(x, b)) if shared_b else _packed_fn(m, n, k, "triton")
        x = a if shared_b else _packed(a, b)
        testing.assert_batch_invariant(fn, x, sizes=[1, 2, 3, 7, 13, 16, 17, B // 2, B - 1])
        testing.assert_padding_invariant(fn, x[:100], before=3, after=29)
        testing.assert_order_invariant(fn, x)
        testing.assert_chunk_invariant(fn, x, chunks=[1, 7, B // 2 - 8, B - B // 2])


@gpu_bench_case
def test_gpu_candidate_configs_agree_bitwise(dtype, shape, gen):
    # Every config the benchmark sweep may propose (so the table can be retuned)
    # must give the table config's bits; fp32 FMA mode included.
    from rlkernels.bench.bmm import candidate_configs

    B, m, n, k = shape
    a, b = _operands(B, m, n, k, dtype, gen, device="cuda")
    want = bmm_mod._triton_bmm(a, b, dtype, config=tiny_config(m, n, k, dtype))
    bad = []
    for cfg in candidate_configs(m, n, k, dtype):
        got = bmm_mod._triton_bmm(a, b, dtype, config=cfg)
        if not torch.equal(got, want):
            bad.append(cfg.short())
    assert not bad, f"configs giving other bits than the table's {tiny_config(m, n, k, dtype).short()}: {bad}"


@gpu_bench_case
def test_gpu_tiny_matches_general_path(dtype, shape, gen):
    # The canonical chain says: fp32 is a sequential FMA chain on both paths, and
    # 16-bit is the tensor cores' 16-wide K-step chain on both paths, so the bits
    # should agree. A mismatch is reported (xfail for 16-bit), not forced.
    B, m, n, k = shape
    a, b = _operands(B, m, n, k, dtype, gen, device="cuda")
    tiny = bmm_mod._triton_bmm(a, b, dtype)
    general = bmm_mod._triton_bmm(a, b, dtype, force_general=True)
    if not torch.equal(tiny, general):
        diff = (tiny != general).sum().item()
        msg = f"tiny vs general path: {diff} of {tiny.numel()} elements differ for {dtype} {shape}"
        if dtype == torch.float32:
            pytest.fail(msg)
        pytest.xfail(msg)


@gpu_bench_case
def test_gpu_autograd(dtype, shape, gen):
    B, m, n, k = shape
    for shared_b in (False, True):
        a, b = _operands(B, m, n, k, dtype, gen, shared_b=shared_b, device="cuda")
        a.requires_grad_()
        b.requires_grad_()
        out = bmm(a, b)
        grad = randn(*out.shape, dtype=dtype, generator=gen, device="cuda")
        out.backward(grad)
        ga, gb = _grads_ref(a, b, grad)
        db_tol = SHARED_DB_TOL if shared_b else GRAD_TOL
        for got, want, what, tol in ((a.grad, ga, "dA", GRAD_TOL), (b.grad, gb, "dB", db_tol)):
            err = testing.rel_error(got, want)
            assert err <= tol[dtype], f"{what} ({'shared' if shared_b else 'batched'} b) rel error {err:.3e}"


# fp32 FMA shapes whose default group was once not a power of two (17 x 5 x 33: G = 3,
# a CompilationError at tl.arange on every Triton), and odd shapes of other config classes.
GPU_ODD_SHAPES = [(17, 5, 33), (64, 3, 63), (1, 1, 63), (5, 64, 47), (33, 8, 64), (63, 63, 63), (2, 9, 17)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("m,n,k", GPU_ODD_SHAPES, ids=lambda v: str(v))
def test_gpu_odd_shapes_run_on_the_tiny_kernel(dtype, m, n, k, gen):
    a, b = _operands(37, m, n, k, dtype, gen, device="cuda")
    out = bmm(a, b)  # raises if the tiny kernel fails: there is no fallback
    _check_accuracy(out, a, b, dtype)
    testing.assert_batch_invariant(_packed_fn(m, n, k, "triton"), _packed(a, b), sizes=[1, 2, 17, 36])
    if dtype == torch.float32:  # the same sequential FMA chain on both paths
        assert torch.equal(out, bmm_mod._triton_bmm(a, b, dtype, force_general=True))
