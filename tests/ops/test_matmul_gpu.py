"""GPU proofs for the canonical K-chain: every backend and every table config, same bits."""
from __future__ import annotations

import pytest
import torch

from rlkernels.gemm import table as gemm_table

import rlkernels
from rlkernels import contract, reference, testing
from rlkernels.gemm import cublaslt, triton as gemm

pytestmark = pytest.mark.gpu

# (K, N) pairs from the issue, the lm head shrunk in N to keep the test quick.
SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288), (4096, 8192)]
# Unaligned shapes (N, K not multiples of 8 or of any tile): the dispatcher never sends
# these to cuBLASLt, so the Triton configs must agree among themselves.
UNALIGNED = [(4096, 8191), (1000, 1001), (77, 131)]
ROWS = [1, 2, 3, 7, 8, 13, 16, 17, 61, 64, 97, 128, 255, 1000, 1024, 4099]


def _data(m, k, n, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", SHAPES)
def test_every_config_and_cublaslt_give_the_same_bits(dtype, k, n):
    x, w = _data(max(ROWS), k, n, dtype)
    canonical = cublaslt.cublaslt_linear(x, w, None)
    bad = []
    for cfg in gemm_table.all_configs(dtype):
        for m in ROWS:
            got = gemm.triton_gemm(x[:m], w.t(), config=cfg)
            if not torch.equal(got, canonical[:m]):
                bad.append((cfg.short(), m, int((got != canonical[:m]).sum())))
        # cuBLASLt-no-split alone is row-invariant too
    for m in ROWS:
        if not torch.equal(cublaslt.cublaslt_linear(x[:m], w, None), canonical[:m]):
            bad.append(("cublaslt", m, -1))
    assert not bad, f"configs/rows off the canonical chain: {bad[:12]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_given_transposed_gives_the_same_bits(dtype):
    # rlkernels.linear passes the [N, K] weight as is (b_transposed): every config the
    # table can pick reads it like the W^T view, and so does the public path.
    x, w = _data(300, 4096, 1024, dtype)
    bias = torch.randn(1024, device="cuda").to(dtype)
    bad = [(cfg.short(), m) for cfg in gemm_table.all_configs(dtype) for m in (1, 7, 16, 64, 300)
           if not torch.equal(gemm.triton_gemm(x[:m], w, bias=bias, config=cfg, b_transposed=True),
                              gemm.triton_gemm(x[:m], w.t(), bias=bias, config=cfg))]
    assert not bad, bad
    for m in (1, 16, 64, 65, 300):
        assert torch.equal(rlkernels.linear(x[:m], w, bias), rlkernels.matmul(x[:m], w.t(), bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", UNALIGNED)
def test_triton_configs_agree_on_unaligned_shapes(dtype, k, n):
    x, w = _data(max(ROWS), k, n, dtype)
    first = gemm.triton_gemm(x, w.t(), config=gemm_table.all_configs(dtype)[0])
    bad = [(cfg.short(), m) for cfg in gemm_table.all_configs(dtype)[1:] for m in ROWS
           if not torch.equal(gemm.triton_gemm(x[:m], w.t(), config=cfg), first[:m])]
    lt_same = torch.equal(cublaslt.cublaslt_linear(x, w, None), first)
    print(f"[unaligned] {dtype} K={k} N={n}: cuBLASLt-no-split same bits as the chain: {lt_same}")
    assert not bad, bad[:12]
    testing.assert_batch_invariant(lambda rows: rlkernels.linear(rows, w), x, sizes=[1, 3, 16, 17, 64, 65, 300, 4099])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_epilogue_matches_cublaslt(dtype):
    x, w = _data(1031, 4096, 4096, dtype)
    bias = torch.randn(4096, device="cuda").to(dtype)
    want = cublaslt.cublaslt_linear(x, w, bias)
    for cfg in gemm_table.all_configs(dtype):
        assert torch.equal(gemm.triton_gemm(x, w.t(), bias=bias, config=cfg), want), cfg.short()


@pytest.mark.parametrize("k,n", [(4096, 4096), (1000, 1001), (77, 131)])
def test_fp32_configs_agree_and_are_ieee(k, n):
    """Every fp32 tile, forward or swapped orientation, runs the same FMA chain per element."""
    x, w = _data(max(ROWS), k, n, torch.float32)
    bias = torch.randn(n, device="cuda")
    first = gemm.triton_gemm(x, w.t(), bias=bias, config=gemm_table.all_configs(torch.float32)[0])
    bad = [(cfg.short(), m) for cfg in gemm_table.all_configs(torch.float32) for m in ROWS
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dispatcher_rows_invariant(dtype):
    x, w = _data(4099, 4096, 1024, dtype)
    bias = torch.randn(1024, device="cuda").to(dtype)

    def fn(rows):
        return rlkernels.linear(rows, w, bias)

    testing.assert_batch_invariant(fn, x, sizes=[1, 2, 3, 7, 16, 17, 64, 65, 127, 128, 129, 1000, 4096])
    testing.assert_chunk_invariant(fn, x[:1500], chunks=[1, 16, 100, 383, 1000])
    testing.assert_padding_invariant(fn, x[:50], before=77, after=300)
    testing.assert_order_invariant(fn, x[:700])
    contract.check("matmul", dtype, fn(x[:64]), reference.linear_ref(x[:64], w, bias))


def test_lm_head_rows_invariant_across_the_backend_boundary():
    # An lm head runs on the Triton tile up to M = 128 and on cuBLASLt-no-split above
    # (matmul.cublaslt_min_m): rows must not notice which one a batch size picks.
    x, w = _data(300, 4096, 151936, torch.bfloat16)
    testing.assert_batch_invariant(lambda rows: rlkernels.linear(rows, w), x,
                                   sizes=[1, 16, 64, 65, 127, 128, 129, 200, 300])


def test_forced_backends_agree(monkeypatch):
    x, w = _data(2048, 4096, 2048, torch.bfloat16)
    monkeypatch.setenv("RLKERNELS_GEMM_BACKEND", "triton")
    tri = rlkernels.linear(x, w)
    monkeypatch.setenv("RLKERNELS_GEMM_BACKEND", "cublaslt")
    lt = rlkernels.linear(x, w)
    assert torch.equal(tri, lt)


def _gpu_linear(x):
    w = (torch.randn(1536, x.shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))).bfloat16()
    return rlkernels.linear(x, w)


def test_cross_process_determinism():
    x = torch.randn(777, 2048, device="cuda").bfloat16()
    testing.assert_deterministic(_gpu_linear, x, runs=3, processes=2)


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
        x, w = _data(512, 4096, 1024, torch.bfloat16)
        assert cublaslt.cublaslt_verified(x.device, x.dtype, 4096, False)  # the call below takes cuBLASLt
        rlkernels.linear(x, w)
        rlkernels.linear(x.half(), w.half())
        assert torch.backends.cuda.preferred_blas_library() == lib
        assert (C._get_cublas_allow_bf16_reduced_precision_reduction(),
                C._get_cublas_allow_fp16_reduced_precision_reduction()) == pairs
    finally:
        C._set_cublas_allow_bf16_reduced_precision_reduction(*saved[0])
        C._set_cublas_allow_fp16_reduced_precision_reduction(*saved[1])


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [12289, 151936])
def test_n_contiguous_b_has_its_own_decode_tile_and_the_same_bits(dtype, n):
    # rlkernels.matmul(x, b) with b a row-major [K, N] matrix takes the N-contiguous decode
    # tile at M <= 16; its rows are the nn.Linear layout's rows bit for bit.
    x, w = _data(64, 4096, n, dtype)
    b = w.t().contiguous()
    wide = gemm_table.GEMM_TABLE_16BIT_N_CONTIGUOUS_B[0][2]
    assert gemm_table.gemm_config(16, n, dtype, b_n_contiguous=True) == wide
    assert gemm_table.gemm_config(16, n, dtype) != wide
    for m in (1, 7, 16, 17, 64):
        assert torch.equal(rlkernels.matmul(x[:m], b), rlkernels.linear(x[:m], w)), m
