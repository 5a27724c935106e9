"""matmul / linear on the CPU: torch backend and (with TRITON_INTERPRET=1) the Triton kernel."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import contract, reference, testing
from rlkernels.gemm import cublaslt, table as gemm_table, triton as gemm
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

# ---------------------------------------------------------------- on a CUDA device: the canonical
# K-chain from every backend and every table config, the same bits.

# (K, N) pairs from the issue, the lm head shrunk in N to keep the test quick.
GPU_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288), (4096, 8192)]
# Unaligned shapes (N, K not multiples of 8 or of any tile): the dispatcher never sends
# these to cuBLASLt, so the Triton configs must agree among themselves.
GPU_UNALIGNED = [(4096, 8191), (1000, 1001), (77, 131)]
GPU_ROWS = [1, 2, 3, 7, 8, 13, 16, 17, 61, 64, 97, 128, 255, 1000, 1024, 4099]


def _gpu_data(m, k, n, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    return x, w


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", GPU_SHAPES)
def test_every_config_and_cublaslt_give_the_same_bits(dtype, k, n):
    x, w = _gpu_data(max(GPU_ROWS), k, n, dtype)
    canonical = cublaslt.cublaslt_linear(x, w, None)
    bad = []
    for cfg in gemm_table.all_configs(dtype):
        for m in GPU_ROWS:
            got = gemm.triton_gemm(x[:m], w.t(), config=cfg)
            if not torch.equal(got, canonical[:m]):
                bad.append((cfg.short(), m, int((got != canonical[:m]).sum())))
        # cuBLASLt-no-split alone is row-invariant too
    for m in GPU_ROWS:
        if not torch.equal(cublaslt.cublaslt_linear(x[:m], w, None), canonical[:m]):
            bad.append(("cublaslt", m, -1))
    assert not bad, f"configs/rows off the canonical chain: {bad[:12]}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_given_transposed_gives_the_same_bits(dtype):
    # rlkernels.linear passes the [N, K] weight as is (b_transposed): every config the
    # table can pick reads it like the W^T view, and so does the public path.
    x, w = _gpu_data(300, 4096, 1024, dtype)
    bias = torch.randn(1024, device="cuda").to(dtype)
    bad = [(cfg.short(), m) for cfg in gemm_table.all_configs(dtype) for m in (1, 7, 16, 64, 300)
           if not torch.equal(gemm.triton_gemm(x[:m], w, bias=bias, config=cfg, b_transposed=True),
                              gemm.triton_gemm(x[:m], w.t(), bias=bias, config=cfg))]
    assert not bad, bad
    for m in (1, 16, 64, 65, 300):
        assert torch.equal(rlkernels.linear(x[:m], w, bias), rlkernels.matmul(x[:m], w.t(), bias))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", GPU_UNALIGNED)
def test_triton_configs_agree_on_unaligned_shapes(dtype, k, n):
    x, w = _gpu_data(max(GPU_ROWS), k, n, dtype)
    first = gemm.triton_gemm(x, w.t(), config=gemm_table.all_configs(dtype)[0])
    bad = [(cfg.short(), m) for cfg in gemm_table.all_configs(dtype)[1:] for m in GPU_ROWS
           if not torch.equal(gemm.triton_gemm(x[:m], w.t(), config=cfg), first[:m])]
    lt_same = torch.equal(cublaslt.cublaslt_linear(x, w, None), first)
    print(f"[unaligned] {dtype} K={k} N={n}: cuBLASLt-no-split same bits as the chain: {lt_same}")
    assert not bad, bad[:12]
    testing.assert_batch_invariant(lambda rows: rlkernels.linear(rows, w), x, sizes=[1, 3, 16, 17, 64, 65, 300, 4099])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_epilogue_matches_cublaslt(dtype):
    x, w = _gpu_data(1031, 4096, 4096, dtype)
    bias = torch.randn(4096, device="cuda").to(dtype)
    want = cublaslt.cublaslt_linear(x, w, bias)
    for cfg in gemm_table.all_configs(dtype):
        assert torch.equal(gemm.triton_gemm(x, w.t(), bias=bias, config=cfg), want), cfg.short()


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 4096), (1000, 1001), (77, 131)])
def test_fp32_configs_agree_and_are_ieee(k, n):
    """Every fp32 tile, forward or swapped orientation, runs the same FMA chain per element."""
    x, w = _gpu_data(max(GPU_ROWS), k, n, torch.float32)
    bias = torch.randn(n, device="cuda")
    first = gemm.triton_gemm(x, w.t(), bias=bias, config=gemm_table.all_configs(torch.float32)[0])
    bad = [(cfg.short(), m) for cfg in gemm_table.all_configs(torch.float32) for m in GPU_ROWS
           if not torch.equal(gemm.triton_gemm(x[:m], w.t(), bias=bias, config=cfg), first[:m])]
    assert not bad, bad[:12]
    contract.check("matmul", torch.float32, first, reference.linear_ref(x, w, bias))
    # The same bits through matmul's row-major B (the unswapped table) and a chained output.
    b_kn = w.t().contiguous()
    for m in (1, 4, 5, 64, 300, 4099):
        assert torch.equal(rlkernels.matmul(x[:m], b_kn, bias), first[:m]), m
        start = torch.randn(m, n, device="cuda")
        acc_swapped = gemm.triton_gemm(x[:m], w.t(), out=start.clone(), accumulate=True)
        acc_plain = gemm.triton_gemm(x[:m], b_kn, out=start.clone(), accumulate=True)
        assert torch.equal(acc_swapped, acc_plain), m


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dispatcher_rows_invariant(dtype):
    x, w = _gpu_data(4099, 4096, 1024, dtype)
    bias = torch.randn(1024, device="cuda").to(dtype)

    def fn(rows):
        return rlkernels.linear(rows, w, bias)

    testing.assert_batch_invariant(fn, x, sizes=[1, 2, 3, 7, 16, 17, 64, 65, 127, 128, 129, 1000, 4096])
    testing.assert_chunk_invariant(fn, x[:1500], chunks=[1, 16, 100, 383, 1000])
    testing.assert_padding_invariant(fn, x[:50], before=77, after=300)
    testing.assert_order_invariant(fn, x[:700])
    contract.check("matmul", dtype, fn(x[:64]), reference.linear_ref(x[:64], w, bias))


@pytest.mark.gpu
def test_lm_head_rows_invariant_across_the_backend_boundary():
    # An lm head runs on the Triton tile up to M = 128 and on cuBLASLt-no-split above
    # (matmul.cublaslt_min_m): rows must not notice which one a batch size picks.
    x, w = _gpu_data(300, 4096, 151936, torch.bfloat16)
    testing.assert_batch_invariant(lambda rows: rlkernels.linear(rows, w), x,
                                   sizes=[1, 16, 64, 65, 127, 128, 129, 200, 300])


@pytest.mark.gpu
def test_forced_backends_agree(monkeypatch):
    x, w = _gpu_data(2048, 4096, 2048, torch.bfloat16)
    monkeypatch.setenv("RLKERNELS_GEMM_BACKEND", "triton")
    tri = rlkernels.linear(x, w)
    monkeypatch.setenv("RLKERNELS_GEMM_BACKEND", "cublaslt")
    lt = rlkernels.linear(x, w)
    assert torch.equal(tri, lt)


def _gpu_linear(x):
    w = (torch.randn(1536, x.shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))).bfloat16()
    return rlkernels.linear(x, w)


@pytest.mark.gpu
def test_cross_process_determinism():
    x = torch.randn(777, 2048, device="cuda").bfloat16()
    testing.assert_deterministic(_gpu_linear, x, runs=3, processes=2)


@pytest.mark.gpu
@pytest.mark.parametrize("user_pairs", [None, ((False, False), (False, True))])
def test_stock_flags_unchanged(user_pairs):
    # user_pairs: a caller who set the (allow_reduced_precision, allow_splitk) pairs
    # themselves, split-K forbidden, must find them so after rlkernels calls.
    C = torch._C
    saved = (C._get_cublas_allow_bf16_reduced_precision_reduction(),
             C._get_cublas_allow_fp16_reduced_precision_reduction())
    try:
        if user_pairs is not None:
            C._set_cublas_allow_bf16_reduced_precision_reduction(*user_pairs[0])
            C._set_cublas_allow_fp16_reduced_precision_reduction(*user_pairs[1])
        lib = torch.backends.cuda.preferred_blas_library()
        pairs = (C._get_cublas_allow_bf16_reduced_precision_reduction(),
                 C._get_cublas_allow_fp16_reduced_precision_reduction())
        x, w = _gpu_data(512, 4096, 1024, torch.bfloat16)
        assert cublaslt.cublaslt_verified(x.device, x.dtype, 4096, False)  # the call below takes cuBLASLt
        rlkernels.linear(x, w)
        rlkernels.linear(x.half(), w.half())
        assert torch.backends.cuda.preferred_blas_library() == lib
        assert (C._get_cublas_allow_bf16_reduced_precision_reduction(),
                C._get_cublas_allow_fp16_reduced_precision_reduction()) == pairs
    finally:
        C._set_cublas_allow_bf16_reduced_precision_reduction(*saved[0])
        C._set_cublas_allow_fp16_reduced_precision_reduction(*saved[1])


@pytest.mark.gpu
def test_output_over_2_31_elements():
    m, k, n = 16448, 64, 131072  # 2.156e9 outputs > 2^31
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    out = rlkernels.linear(x, w)
    for rows in (slice(0, 4), slice(m - 4, m)):
        contract.check("matmul", torch.bfloat16, out[rows], reference.linear_ref(x[rows], w))
        assert torch.equal(out[rows], rlkernels.linear(x[rows], w))
    del out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_microbatch_dw_bitwise_at_real_size(dtype):
    T, K, N = 4096, 1024, 1024
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(T, K, device="cuda", generator=g).to(dtype)
    dy = torch.randn(T, N, device="cuda", generator=g).to(dtype)

    def run(splits):
        lin = rlkernels.Linear(K, N, device="cuda", dtype=dtype)
        lin.weight.main_grad = torch.zeros(N, K, device="cuda")
        lin.bias.main_grad = torch.zeros(N, device="cuda")
        for lo, hi in zip(splits[:-1], splits[1:]):
            lin(x[lo:hi]).backward(dy[lo:hi])
        return lin.weight.main_grad, lin.bias.main_grad

    w_one, b_one = run([0, T])
    for splits in ([0, 2048, T], [0, 1008, T], list(range(0, T + 1, 64)), [0, 16, 48, 3000 - 3000 % 16, T]):
        w, b = run(splits)
        assert torch.equal(w, w_one), splits[:4]
        assert torch.equal(b, b_one), splits[:4]
    contract.check("matmul_fp32_out", dtype, w_one, reference.matmul_ref(dy.t(), x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [12289, 151936])
def test_n_contiguous_b_has_its_own_decode_tile_and_the_same_bits(dtype, n):
    # rlkernels.matmul(x, b) with b a row-major [K, N] matrix takes the N-contiguous decode
    # tile at M <= 16; its rows are the nn.Linear layout's rows bit for bit.
    x, w = _gpu_data(64, 4096, n, dtype)
    b = w.t().contiguous()
    wide = gemm_table.GEMM_TABLE_16BIT_N_CONTIGUOUS_B[0][2]
    assert gemm_table.gemm_config(16, n, dtype, b_n_contiguous=True) == wide
    assert gemm_table.gemm_config(16, n, dtype) != wide
    for m in (1, 7, 16, 17, 64):
        assert torch.equal(rlkernels.matmul(x[:m], b), rlkernels.linear(x[:m], w)), m


def test_linear_group_is_one_linear_per_weight_with_gradients_off_the_gpu(gen):
    from rlkernels.ops.matmul import fused_decode_gemm_ok, linear_group

    x = randn(2, 5, 24, generator=gen, scale=2.0).requires_grad_()
    weights = [randn(n, 24, generator=gen, scale=0.3).requires_grad_() for n in (19, 7, 7)]
    assert not fused_decode_gemm_ok(x, weights, 16)
    outs = linear_group(x, weights)
    refs = [rlkernels.linear(x, w) for w in weights]
    assert len(outs) == 3
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape and torch.equal(out.view(torch.int32), ref.view(torch.int32))
    loss = sum(o.square().sum() for o in outs)
    ref_loss = sum(r.square().sum() for r in refs)
    grads = torch.autograd.grad(loss, (x, *weights))
    ref_grads = torch.autograd.grad(ref_loss, (x, *weights))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_linear_group_refuses_what_linear_refuses():
    from rlkernels.ops.matmul import linear_group

    with pytest.raises(ValueError, match="linear_group: needs at least one weight"):
        linear_group(torch.randn(3, 8), [])
    with pytest.raises((ValueError, RuntimeError), match="linear"):
        linear_group(torch.randn(3, 8), [torch.randn(5, 8), torch.randn(5, 7)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_group_one_launch_gives_each_linears_bits_gpu(dtype):
    from rlkernels.gemm.table import LINEAR_GROUP_MAX_M
    from rlkernels.ops.matmul import fused_decode_gemm_ok, linear_group

    g = torch.Generator().manual_seed(13)
    # q, k, v of 2B- and 8B-class attention, odd widths, and two members.
    for k, ns in (((2048, (2048, 1024, 1024)), (4096, (4096, 1024, 1024)), (1000, (3001, 77, 77)),
                   (2048, (2048, 512)))):
        x = (torch.randn(LINEAR_GROUP_MAX_M + 1, 2, k, generator=g) * 2).to(dtype).cuda()[:, 1]  # strided rows
        weights = [(torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).cuda() for n in ns]
        with torch.no_grad():
            for m in (1, 5, 9, LINEAR_GROUP_MAX_M):
                rows = x[:m]
                assert fused_decode_gemm_ok(rows, weights, LINEAR_GROUP_MAX_M), (k, ns, m)
                outs = linear_group(rows, weights)
                for out, w in zip(outs, weights):
                    assert testing._bits_equal(out, rlkernels.linear(rows, w)), (k, ns, m, dtype)
                alone = linear_group(rows[m - 1:m], weights)
                assert all(testing._bits_equal(a, o[m - 1:m]) for a, o in zip(alone, outs)), (k, ns, m)
            big = (torch.randn(LINEAR_GROUP_MAX_M + 60, k, generator=g) * 2).to(dtype).cuda()
            assert not fused_decode_gemm_ok(big, weights, LINEAR_GROUP_MAX_M)
            assert all(testing._bits_equal(a[:7], b) for a, b in zip(linear_group(big, weights),
                                                                      linear_group(big[:7], weights)))


def test_linear_residual_is_the_add_after_the_linear_off_the_gpu(gen):
    from rlkernels.ops.matmul import linear_residual

    x = randn(2, 5, 24, generator=gen, scale=2.0).requires_grad_()
    w = randn(19, 24, generator=gen, scale=0.3).requires_grad_()
    residual = randn(2, 5, 19, generator=gen, scale=8.0).requires_grad_()
    out = linear_residual(x, w, residual)
    ref = residual + rlkernels.linear(x, w)
    assert out.shape == ref.shape and torch.equal(out.view(torch.int32), ref.view(torch.int32))
    grads = torch.autograd.grad(out.square().sum(), (x, w, residual))
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, w, residual))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    with pytest.raises((ValueError, RuntimeError), match="linear"):
        linear_residual(torch.randn(3, 8), torch.randn(5, 7), torch.randn(3, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_residual_one_launch_gives_the_two_ops_bits_gpu(dtype):
    from rlkernels.gemm.table import LINEAR_RESIDUAL_MAX_M
    from rlkernels.ops.matmul import fused_decode_gemm_ok, linear_residual

    g = torch.Generator().manual_seed(19)
    for k, n in ((6144, 2048), (2048, 2048), (1000, 3001)):  # down and o projections, odd widths
        x = (torch.randn(LINEAR_RESIDUAL_MAX_M, k, generator=g) * 2).to(dtype).cuda()
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).cuda()
        residual = (torch.randn(LINEAR_RESIDUAL_MAX_M, n, generator=g) * 8).to(dtype).cuda()
        with torch.no_grad():
            for m in (1, 5, LINEAR_RESIDUAL_MAX_M):
                assert fused_decode_gemm_ok(x[:m], (w,), LINEAR_RESIDUAL_MAX_M)
                out = linear_residual(x[:m], w, residual[:m])
                assert testing._bits_equal(out, residual[:m] + rlkernels.linear(x[:m], w)), (k, n, m, dtype)
                assert testing._bits_equal(linear_residual(x[m - 1:m], w, residual[m - 1:m]), out[m - 1:m])
