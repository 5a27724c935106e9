"""matmul / linear on the CPU: torch backend and (with TRITON_INTERPRET=1) the Triton kernel."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import contract, reference, testing
from rlkernels.registry import BackendUnavailableError
from rlkernels._env import triton_interpret

from ..conftest import cpu_backend_cases, randn

SHAPES = [(1, 1, 1), (7, 13, 5), (33, 97, 31), (64, 128, 80), (2, 300, 17)]  # (M, K, N): primes, 1, non-multiples


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases())
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_accuracy(backend, dtype, m, k, n, with_bias, gen):
    a, b = randn(m, k, dtype=dtype, generator=gen), randn(k, n, dtype=dtype, generator=gen)
    bias = randn(n, dtype=dtype, generator=gen) if with_bias else None
    out = rlkernels.matmul(a, b, bias, backend=backend)
    assert out.dtype == dtype and out.shape == (m, n)
    contract.check("matmul", dtype, out, reference.matmul_ref(a, b, bias))
    out32 = rlkernels.get_op("matmul", backend).forward_fp32(a, b, bias)
    assert out32.dtype == torch.float32
    assert torch.equal(out32.to(dtype), out)  # native output is the fp32 chain rounded once


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases())
def test_matmul_row_invariance(backend, dtype, gen):
    w = randn(45, 131, dtype=dtype, generator=gen, scale=0.1)
    bias = randn(45, dtype=dtype, generator=gen)
    x = randn(40, 131, dtype=dtype, generator=gen)

    def fn(rows):
        return rlkernels.linear(rows, w, bias, backend=backend)

    testing.assert_batch_invariant(fn, x)
    testing.assert_chunk_invariant(fn, x, chunks=[5, 1, 17, 17])
    testing.assert_padding_invariant(fn, x[:9], before=4, after=11)
    testing.assert_order_invariant(fn, x)


def test_kit_catches_stock_cpu_blas(gen):
    # The kit must be able to fail: stock CPU BLAS changes rows with the batch size.
    a = randn(64, 512, generator=gen)
    with pytest.raises(testing.InvarianceError, match="rows differ"):
        testing.assert_batch_invariant(lambda x: x @ randn(512, 300, generator=torch.Generator().manual_seed(1)), a,
                                       sizes=[1, 2, 3, 7])


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_matmul_deterministic_across_processes(backend, dtype, monkeypatch):
    monkeypatch.setenv("RLKERNELS_BACKEND", backend)
    x = randn(9, 64, generator=torch.Generator().manual_seed(3))
    testing.assert_deterministic(_fixed_weight_linear, x, runs=2, processes=1)


def _fixed_weight_linear(x: torch.Tensor) -> torch.Tensor:
    w = randn(24, x.shape[1], generator=torch.Generator().manual_seed(7))
    return rlkernels.linear(x, w)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_strides_batch_dims_and_empty(backend, dtype, gen):
    w = randn(40, 24, dtype=dtype, generator=gen)  # nn.Linear layout [N, K]
    x3 = randn(3, 5, 24, dtype=dtype, generator=gen)
    out = rlkernels.linear(x3, w, backend=backend)
    assert out.shape == (3, 5, 40)
    flat = rlkernels.linear(x3.reshape(15, 24), w, backend=backend)
    assert torch.equal(out.reshape(15, 40), flat)
    # a transposed (non-contiguous) b gives the same bits as its contiguous copy
    assert torch.equal(rlkernels.matmul(x3[0], w.t(), backend=backend),
                       rlkernels.matmul(x3[0], w.t().contiguous(), backend=backend))
    xt = randn(24, 6, dtype=dtype, generator=gen).t()  # non-contiguous rows
    assert torch.equal(rlkernels.linear(xt, w, backend=backend), rlkernels.linear(xt.contiguous(), w, backend=backend))
    empty = rlkernels.linear(x3[:0], w, backend=backend)
    assert empty.shape == (0, 5, 40)
    zero_k = rlkernels.matmul(randn(4, 0, dtype=dtype), randn(0, 3, dtype=dtype), backend=backend)
    assert torch.equal(zero_k, torch.zeros(4, 3, dtype=dtype))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 24), k=st.integers(1, 70), n=st.integers(1, 40), split=st.integers(0, 24),
       seed=st.integers(0, 2**16))
def test_random_shapes_torch_backend(m, k, n, split, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = randn(m, k, generator=g), randn(k, n, generator=g)
    full = rlkernels.matmul(a, b, backend="torch")
    contract.check("matmul", torch.float32, full, reference.matmul_ref(a, b))
    s = min(split, m)
    parts = torch.cat([rlkernels.matmul(a[:s], b, backend="torch"), rlkernels.matmul(a[s:], b, backend="torch")])
    assert torch.equal(parts, full)


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 12), k=st.integers(1, 70), n=st.integers(1, 70), split=st.integers(0, 12),
       seed=st.integers(0, 2**16), half=st.booleans())
def test_random_shapes_triton_interpreter(m, k, n, split, seed, half):
    dtype = torch.float16 if half else torch.float32
    g = torch.Generator().manual_seed(seed)
    a, b = randn(m, k, dtype=dtype, generator=g), randn(k, n, dtype=dtype, generator=g)
    full = rlkernels.matmul(a, b, backend="triton")
    contract.check("matmul", dtype, full, reference.matmul_ref(a, b))
    s = min(split, m)
    parts = torch.cat([rlkernels.matmul(a[:s], b, backend="triton"), rlkernels.matmul(a[s:], b, backend="triton")])
    assert torch.equal(parts, full)


def test_bad_input_errors():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with pytest.raises(ValueError, match=r"rlkernels.matmul: inner dimensions differ.*K=8.*K=9"):
        rlkernels.matmul(a, torch.randn(9, 3))
    with pytest.raises(ValueError, match=r"rlkernels.matmul: .*dtype torch.int64"):
        rlkernels.matmul(a.long(), b.long())
    with pytest.raises(ValueError, match=r"rlkernels.matmul: tensors must share one dtype"):
        rlkernels.matmul(a, b.half())
    with pytest.raises(ValueError, match=r"rlkernels.matmul: b must have 2 dims"):
        rlkernels.matmul(a, torch.randn(2, 8, 3))
    with pytest.raises(ValueError, match=r"rlkernels.linear: bias must have shape \(5,\)"):
        rlkernels.linear(a, torch.randn(5, 8), torch.randn(4))
    with pytest.raises(TypeError, match=r"rlkernels.matmul: input must be a torch.Tensor"):
        rlkernels.matmul([[1.0]], b)
    with pytest.raises(ValueError, match=r"one device"):
        rlkernels.matmul(a, b.to("meta"))
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        rlkernels.get_op("matmul", "cuda-magic")


def test_forced_triton_without_gpu_refuses(monkeypatch):
    if triton_interpret():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="triton needs a CUDA"):
        rlkernels.matmul(torch.randn(2, 3), torch.randn(3, 4), backend="triton")
    monkeypatch.setenv("RLKERNELS_BACKEND", "triton")
    with pytest.raises(BackendUnavailableError, match="RLKERNELS_BACKEND"):
        rlkernels.matmul(torch.randn(2, 3), torch.randn(3, 4))


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
def test_batch_axis_chunked_past_grid_limit(gen, monkeypatch):
    # The launcher splits batches larger than CUDA's grid-axis-1 limit; chunks are
    # independent, so every element's bits are those of the unchunked launch.
    from rlkernels.gemm import triton as gemm

    a, b = randn(5, 3, 8, generator=gen), randn(5, 8, 4, generator=gen)
    whole = gemm.triton_gemm(a, b)
    monkeypatch.setattr(gemm, "MAX_GRID_BATCH", 2)
    assert torch.equal(gemm.triton_gemm(a, b), whole)
    assert torch.equal(gemm.triton_gemm(a, b[0]), gemm.triton_gemm(a.reshape(1, 15, 8), b[0]).reshape(5, 3, 4))


def test_env_get_follows_os_environ(monkeypatch):
    from rlkernels._env import env_get

    monkeypatch.setenv("RLKERNELS_TEST_SWITCH", "on")
    assert env_get("RLKERNELS_TEST_SWITCH") == "on"
    monkeypatch.setenv("RLKERNELS_TEST_SWITCH", "off")
    assert env_get("RLKERNELS_TEST_SWITCH") == "off"
    monkeypatch.delenv("RLKERNELS_TEST_SWITCH")
    assert env_get("RLKERNELS_TEST_SWITCH") is None


@pytest.mark.parametrize("m,n,want", [(32, 4096, False), (33, 4096, True), (64, 4096, True), (33, 8184, True), (33, 8191, False),
                                      (64, 8192, False), (65, 8192, True), (64, 151936, False), (16, 4096, False),
                                      (128, 151936, False), (129, 65536, True), (256, 151936, True)])
def test_auto_dispatch_threshold_depends_on_width(monkeypatch, m, n, want):
    # cuBLASLt-no-split from M = 33 on narrow outputs, from M = 65 on wide ones and from
    # M = 129 on lm heads (where the Triton tiles are faster); both give the canonical
    # bits, so only time decides.
    # (N = 8191: unaligned rows stay on the Triton chain.)
    from rlkernels.gemm import backends as mm

    monkeypatch.delenv("RLKERNELS_GEMM_BACKEND", raising=False)
    monkeypatch.setattr(mm, "cublaslt_available", lambda device, dtype: True)
    monkeypatch.setattr(mm, "cublaslt_verified", lambda device, dtype, k, has_bias: True)
    a = torch.empty(m, 4096, dtype=torch.bfloat16)
    assert mm.TritonGemmBackend().use_cublaslt(a, n, None) is want


def _fake_cublaslt(monkeypatch, verified: bool = True) -> dict:
    """cuBLASLt made 'available' on the CPU: calls are counted, its 'output' is the torch chain's.

    The Triton producer is replaced by the torch chain too (counted), so the routing
    is tested on any CPU, with or without TRITON_INTERPRET."""
    from rlkernels.gemm import backends as mm

    calls = {"use_cublaslt": 0, "cublaslt": 0, "triton": 0}
    real_use = mm.TritonGemmBackend.use_cublaslt

    def counted_use(self, a, n, bias):
        calls["use_cublaslt"] += 1
        return real_use(self, a, n, bias)

    def fake_linear(x, w, bias):
        calls["cublaslt"] += 1
        return mm.TorchGemmBackend().gemm(x, w.t(), bias=bias)

    monkeypatch.setattr(mm, "_CUBLASLT_ROUTES", {})
    monkeypatch.delenv("RLKERNELS_GEMM_BACKEND", raising=False)
    monkeypatch.setattr(mm.TritonGemmBackend, "use_cublaslt", counted_use)
    monkeypatch.setattr(mm, "cublaslt_available", lambda device, dtype: True)
    monkeypatch.setattr(mm, "cublaslt_verified", lambda device, dtype, k, has_bias: verified)
    def fake_triton(a, b, *, bias=None, out=None, out_dtype=None, accumulate=False, rowsum=None,
                    b_transposed=False):
        calls["triton"] += 1
        return mm.TorchGemmBackend().gemm(a, b, bias=bias, out=out, out_dtype=out_dtype, accumulate=accumulate,
                                          rowsum=rowsum, b_transposed=b_transposed)

    monkeypatch.setattr(mm, "linear_no_split_k", fake_linear)
    monkeypatch.setattr(mm, "triton_gemm", fake_triton)
    return calls


@pytest.mark.parametrize("with_bias", [False, True])
def test_cublaslt_route_is_worked_out_once_per_problem(monkeypatch, gen, with_bias):
    from rlkernels.gemm import backends as mm

    calls = _fake_cublaslt(monkeypatch)
    gemm_backend = mm.TritonGemmBackend()
    w = randn(48, 40, dtype=torch.float16, generator=gen)
    bias = randn(48, dtype=torch.float16, generator=gen) if with_bias else None
    for m in (40, 40, 41, 40, 41):
        y = gemm_backend.gemm(randn(m, 40, dtype=torch.float16, generator=gen), w, bias=bias, b_transposed=True)
        assert y.shape == (m, 48)
    assert calls == {"use_cublaslt": 2, "cublaslt": 5, "triton": 0}
    assert len(mm._CUBLASLT_ROUTES) == 2 and all(mm._CUBLASLT_ROUTES.values())


def test_cublaslt_route_follows_the_backend_switch_and_the_mode(monkeypatch, gen):
    # A kept route must not outlive what it was worked out from: forcing Triton, or
    # the batch-invariant mode (where F.linear itself is rerouted to rlkernels, so a
    # detour through it would recurse), turns cuBLASLt off at the next call.
    from rlkernels.gemm import backends as mm

    calls = _fake_cublaslt(monkeypatch)
    gemm_backend = mm.TritonGemmBackend()
    x, w = randn(40, 40, dtype=torch.float16, generator=gen), randn(48, 40, dtype=torch.float16, generator=gen)
    gemm_backend.gemm(x, w, b_transposed=True)
    assert calls["cublaslt"] == 1
    monkeypatch.setenv("RLKERNELS_GEMM_BACKEND", "triton")
    gemm_backend.gemm(x, w, b_transposed=True)
    assert calls["cublaslt"] == 1
    monkeypatch.delenv("RLKERNELS_GEMM_BACKEND")
    monkeypatch.setattr(mm._mode_state, "overrides_installed", lambda: True)
    gemm_backend.gemm(x, w, b_transposed=True)
    assert calls["cublaslt"] == 1
    monkeypatch.setattr(mm._mode_state, "overrides_installed", lambda: False)
    gemm_backend.gemm(x, w, b_transposed=True)
    assert calls == {"use_cublaslt": 3, "cublaslt": 2, "triton": 2}


def test_cublaslt_route_keeps_a_failed_probe_and_is_bounded(monkeypatch, gen):
    from rlkernels.gemm import backends as mm

    calls = _fake_cublaslt(monkeypatch, verified=False)
    monkeypatch.setattr(mm, "MAX_CUBLASLT_ROUTES", 2)
    gemm_backend = mm.TritonGemmBackend()
    w = randn(48, 40, dtype=torch.float16, generator=gen)
    for m in (40, 41, 42, 40):
        x = randn(m, 40, dtype=torch.float16, generator=gen)
        assert torch.equal(gemm_backend.gemm(x, w, b_transposed=True), mm.TorchGemmBackend().gemm(x, w.t()))
        assert 0 < len(mm._CUBLASLT_ROUTES) <= 2 and not any(mm._CUBLASLT_ROUTES.values())
    assert calls == {"use_cublaslt": 4, "cublaslt": 0, "triton": 4}
