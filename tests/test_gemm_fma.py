"""The explicit FMA-chain GEMM (ops.gemm_fma): the canonical fp32 K-chain without tl.dot.

Every output element must be ``acc = fma(a[m, k], b[k, n], acc)`` for k = 0 .. K-1
ascending (from 0, or from C's value when accumulating), then ``+ bias`` in fp32,
rounded once to the output dtype.

CPU: the kernel under TRITON_INTERPRET=1 (the interpreter's ``tl.fma`` rounds once,
like the hardware), bitwise against a float64 emulation of that chain, over the
configs' load modes (K_VEC 1/2/4/8, unrolls, B's k-stride 1 or not), bias,
accumulation, batching, strides, empty shapes and row invariance. GPU: the FMA configs
give the IEEE ``tl.dot`` kernel's bits, and each other's.
"""
from __future__ import annotations

import pytest
import torch

from rlkernels import testing
from rlkernels.ops.gemm import FMA_FALLBACK_CONFIG, GemmConfig, all_configs, triton_gemm
from rlkernels.registry import triton_interpret

from .conftest import randn

interpreter_only = pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")


def _fma(block_m, block_n, block_k, fma_vec, num_warps=4):
    return GemmConfig(block_m, block_n, block_k, 1, num_warps, 1, fma_vec=fma_vec)


# Interpreter configs: K_VEC 4 with one and two vectors per iteration, K_VEC 2 with an
# unroll of 4, K_VEC 1, K_VEC 8; one-row, two-row and 16-row tiles; 16/32/64 columns.
CPU_CONFIGS = {
    "m1n16k4v4": _fma(1, 16, 4, 4),
    "m2n32k8v4": _fma(2, 32, 8, 4),
    "m16n64k8v2": _fma(16, 64, 8, 2),
    "m1n64k4v1": _fma(1, 64, 4, 1),
    "m2n16k8v8": _fma(2, 16, 8, 8),
}
# (M, N, K): K = 1 (tail only), 7 (tail only for block_k 8, one block + tail for 4),
# 37 (several blocks + a tail); N = 1 and 5 (one partial column tile), 70 (several);
# M = 17 (a partial row tile) on a few configs only: the interpreter is slow.
_SHAPES = [(1, 1, 1), (3, 5, 7), (1, 70, 37)]
_EXTRA = {"m1n16k4v4": [(17, 5, 37)], "m2n32k8v4": [(17, 70, 7)], "m16n64k8v2": [(17, 70, 37)],
          "m2n16k8v8": [(3, 70, 37)]}
CPU_CASES = [pytest.param(cfg, *shape, id=f"{name}-{'x'.join(map(str, shape))}")
             for name, cfg in CPU_CONFIGS.items() for shape in _SHAPES + _EXTRA.get(name, [])]
_CFG = list(CPU_CONFIGS.values())


def _fma_chain(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fused fp32 chain in float64: r = fp32(a[:, k] * b[k, :] + r), k ascending.

    a [..., M, K], b [..., K, N] (broadcast over leading dims), fp32. A product of two
    fp32 values is exact in float64, so each step is one rounding of the exact
    a*b + r (up to double rounding, which random data does not hit).
    """
    a64, b64 = a.double(), b.double()
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    r = torch.zeros(shape, dtype=torch.float32) if acc is None else acc.float().clone()
    for k in range(a.shape[-1]):
        r = (a64[..., :, k, None] * b64[..., k, None, :] + r.double()).float()
    if bias is not None:
        r = r + bias.float()  # one fp32 add
    return r.to(out_dtype)


def _operands(m, n, k, gen, layout, batch=()):
    """a [*batch, M, K]; b [K, N] as W^T (k-stride 1, nn.Linear) or row-major (n-stride 1)."""
    a = randn(*batch, m, k, generator=gen)
    w = randn(*batch, n, k, generator=gen, scale=max(k, 1) ** -0.5)
    b = w.transpose(-1, -2)
    if layout == "row_major":
        b = b.contiguous()
        assert b.stride(-2) != 1 or n == 1
    else:
        assert b.stride(-2) == 1
    return a, b


# ---------------------------------------------------------------------------------
# The oracle itself


def test_oracle_is_fused():
    """The emulation rounds a*b + r once: it differs from multiply-then-add here."""
    a = torch.tensor([[1.0 + 2.0 ** -11, 1.0 + 2.0 ** -12]])
    b = torch.tensor([[1.0], [-(1.0 + 2.0 ** -12)]])
    # a1*b1 = -(1 + 2^-11 + 2^-24) exactly; rounded alone it ties to -(1 + 2^-11),
    # which cancels the first term: unfused gives 0, fused keeps -2^-24.
    assert _fma_chain(a, b).item() == -(2.0 ** -24)
    assert (a[0, 0] * b[0, 0] + a[0, 1] * b[1, 0]).item() == 0.0


# ---------------------------------------------------------------------------------
# Interpreter: bits against the oracle


@interpreter_only
@pytest.mark.parametrize("layout", ["linear", "row_major"])
@pytest.mark.parametrize("cfg,m,n,k", CPU_CASES)
def test_bits_equal_fma_chain(cfg, m, n, k, layout, gen):
    a, b = _operands(m, n, k, gen, layout)
    bias = randn(n, generator=gen)
    got = triton_gemm(a, b, config=cfg)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.equal(got, _fma_chain(a, b))
    assert torch.equal(triton_gemm(a, b, bias=bias, config=cfg), _fma_chain(a, b, bias=bias))


@interpreter_only
@pytest.mark.parametrize("layout", ["linear", "row_major"])
@pytest.mark.parametrize("cfg", _CFG[:3], ids=list(CPU_CONFIGS)[:3])
def test_accumulate_starts_from_out(cfg, layout, gen):
    m, n, k = 5, 37, 19
    a, b = _operands(m, n, k, gen, layout)
    bias = randn(n, generator=gen)
    start = randn(m, n, generator=gen)
    out = start.clone()
    got = triton_gemm(a, b, out=out, accumulate=True, config=cfg)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, _fma_chain(a, b, acc=start))
    out = start.clone()
    triton_gemm(a, b, bias=bias, out=out, accumulate=True, config=cfg)
    assert torch.equal(out, _fma_chain(a, b, acc=start, bias=bias))
    # A strided (transposed) accumulation target.
    out_t = start.t().contiguous().t()
    triton_gemm(a, b, out=out_t, accumulate=True, config=cfg)
    assert torch.equal(out_t, _fma_chain(a, b, acc=start))


@interpreter_only
def test_fp16_output_rounds_once(gen):
    # fp16 only: the interpreter casts fp32 -> bf16 by truncation (the GPU rounds to
    # nearest even), for the dot kernel too, so a bf16 output cannot match here.
    out_dtype = torch.float16
    a, b = _operands(6, 40, 23, gen, "linear")
    bias = randn(40, generator=gen)
    got = triton_gemm(a, b, bias=bias, out_dtype=out_dtype, config=_fma(2, 16, 8, 4))
    assert got.dtype == out_dtype
    assert torch.equal(got, _fma_chain(a, b, bias=bias, out_dtype=out_dtype))


@interpreter_only
@pytest.mark.parametrize("layout", ["linear", "row_major"])
@pytest.mark.parametrize("cfg", [_CFG[1], _CFG[3]], ids=["m2n32k8v4", "m1n64k4v1"])
def test_batched(cfg, layout, gen):
    bt, m, n, k = 3, 4, 21, 13
    # 3-D a with a shared 2-D b (batch stride 0).
    a = randn(bt, m, k, generator=gen)
    _, b = _operands(m, n, k, gen, layout)
    bias = randn(n, generator=gen)
    got = triton_gemm(a, b, bias=bias, config=cfg)
    assert got.shape == (bt, m, n)
    assert torch.equal(got, _fma_chain(a, b, bias=bias))
    # 3-D a with a 3-D b.
    a3, b3 = _operands(m, n, k, gen, layout, batch=(bt,))
    got = triton_gemm(a3, b3, config=cfg)
    assert got.shape == (bt, m, n)
    assert torch.equal(got, _fma_chain(a3, b3))
    # Accumulating into a 3-D output.
    start = randn(bt, m, n, generator=gen)
    out = start.clone()
    triton_gemm(a3, b3, out=out, accumulate=True, config=cfg)
    assert torch.equal(out, _fma_chain(a3, b3, acc=start))


@interpreter_only
@pytest.mark.parametrize("cfg", [_CFG[0], _CFG[2]], ids=["m1n16k4v4", "m16n64k8v2"])
def test_noncontiguous_a(cfg, gen):
    m, n, k = 9, 20, 15
    _, b = _operands(m, n, k, gen, "linear")
    # A read M-major (the transpose of a [K, M] tensor: dW = dY^T @ X style).
    a_t = randn(k, m, generator=gen).t()
    assert a_t.stride() == (1, m)
    assert torch.equal(triton_gemm(a_t, b, config=cfg), _fma_chain(a_t, b))
    # A column window of a wider tensor (row stride != K) and a sliced B.
    wide = randn(m, k + 6, generator=gen)
    a_s = wide[:, 2:2 + k]
    b_wide = randn(k, n + 3, generator=gen)
    b_s = b_wide[:, 1:1 + n]
    assert torch.equal(triton_gemm(a_s, b_s, config=cfg), _fma_chain(a_s, b_s))
    # A batched transposed view.
    a3 = randn(2, k, m, generator=gen).transpose(1, 2)
    assert torch.equal(triton_gemm(a3, b, config=cfg), _fma_chain(a3, b))


@interpreter_only
def test_empty_and_k_zero(gen):
    cfg = _fma(2, 16, 8, 4)
    b = randn(20, 7, generator=gen).t()  # [K=7, N=20]
    got = triton_gemm(randn(0, 7, generator=gen), b, config=cfg)
    assert got.shape == (0, 20)
    got = triton_gemm(randn(4, 7, generator=gen), randn(0, 7, generator=gen).t(), config=cfg)
    assert got.shape == (4, 0)
    got = triton_gemm(randn(2, 0, 4, generator=gen), randn(4, 0, generator=gen), config=cfg)
    assert got.shape == (2, 0, 0)
    # K = 0: the empty chain is its start value (0, or out's) plus the bias.
    a0, b0 = randn(3, 0, generator=gen), randn(0, 20, generator=gen)
    bias = randn(20, generator=gen)
    assert torch.equal(triton_gemm(a0, b0, config=cfg), torch.zeros(3, 20))
    assert torch.equal(triton_gemm(a0, b0, bias=bias, config=cfg), _fma_chain(a0, b0, bias=bias))
    start = randn(3, 20, generator=gen)
    out = start.clone()
    triton_gemm(a0, b0, out=out, accumulate=True, config=cfg)
    assert torch.equal(out, start)
    # ... and with a bias, the start value plus the bias, as the kernel's epilogue adds it.
    triton_gemm(a0, b0, bias=bias, out=out, accumulate=True, config=cfg)
    assert torch.equal(out, start + bias)


# ---------------------------------------------------------------------------------
# Interpreter: row invariance


@interpreter_only
@pytest.mark.parametrize("layout", ["linear", "row_major"])
@pytest.mark.parametrize("cfg", [_CFG[1], _CFG[2]], ids=["m2n32k8v4", "m16n64k8v2"])
def test_row_invariance(cfg, layout, gen):
    m, n, k = 11, 24, 29
    a, b = _operands(m, n, k, gen, layout)
    bias = randn(n, generator=gen)

    def fn(rows):
        return triton_gemm(rows, b, bias=bias, config=cfg)

    testing.assert_batch_invariant(fn, a, sizes=[1, 2, 3, 10, 11])
    testing.assert_chunk_invariant(fn, a, chunks=[1, 5, 5])
    testing.assert_padding_invariant(fn, a[:3], before=5, after=10)
    testing.assert_order_invariant(fn, a)
    # A single row alone equals itself at another position in a batch.
    row = a[7:8]
    others = randn(8, k, generator=gen)
    for pos in (0, 5, 8):
        batch = torch.cat([others[:pos], row, others[pos:]])
        assert torch.equal(fn(batch)[pos:pos + 1], fn(row))


# ---------------------------------------------------------------------------------
# Dispatch: 16-bit inputs refused, rowsum sent to the dot kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_input_refused(dtype, gen):
    a = randn(3, 8, dtype=dtype, generator=gen)
    b = randn(5, 8, dtype=dtype, generator=gen).t()
    with pytest.raises(ValueError, match="fp32"):
        triton_gemm(a, b, config=_fma(1, 16, 4, 4))


@interpreter_only
def test_rowsum_takes_the_dot_kernel(gen):
    # dW = dY^T @ X accumulated into main_grad, with the dbias row sums of dY^T.
    tokens, n_out, n_in = 21, 18, 11
    dy = randn(tokens, n_out, generator=gen)
    x = randn(tokens, n_in, generator=gen)
    start = randn(n_out, n_in, generator=gen)
    rs_start = randn(n_out, generator=gen)
    out_fma, rs_fma = start.clone(), rs_start.clone()
    triton_gemm(dy.t(), x, out=out_fma, accumulate=True, rowsum=rs_fma, config=_fma(1, 16, 4, 4))
    out_dot, rs_dot = start.clone(), rs_start.clone()
    triton_gemm(dy.t(), x, out=out_dot, accumulate=True, rowsum=rs_dot, config=FMA_FALLBACK_CONFIG)
    assert torch.equal(out_fma, out_dot)
    assert torch.equal(rs_fma, rs_dot)
    assert not torch.equal(rs_fma, rs_start)  # the row sums were added
    # Without accumulation too.
    rs_fma, rs_dot = rs_start.clone(), rs_start.clone()
    got = triton_gemm(dy.t(), x, rowsum=rs_fma, config=_fma(2, 32, 8, 4))
    want = triton_gemm(dy.t(), x, rowsum=rs_dot, config=FMA_FALLBACK_CONFIG)
    assert torch.equal(got, want) and torch.equal(rs_fma, rs_dot)


# ---------------------------------------------------------------------------------
# GPU: the FMA configs give the IEEE tl.dot kernel's bits


GPU_FMA_CONFIGS = [
    _fma(1, 128, 8, 4),
    _fma(1, 64, 16, 8),
    _fma(4, 64, 8, 2),
    _fma(16, 32, 4, 1),
    _fma(2, 256, 16, 4, num_warps=8),
]
DOT_CONFIG = GemmConfig(16, 64, 32, 1, 4, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["linear", "row_major"])
def test_gpu_fma_configs_match_ieee_dot(layout):
    k, n = 4099, 257  # K not a multiple of 8 (a tail after the vector blocks)
    gen = torch.Generator().manual_seed(4099)
    x, w = randn(31, k, generator=gen), randn(n, k, generator=gen, scale=k ** -0.5)
    bias = randn(n, generator=gen)
    b_cpu = w.t() if layout == "linear" else w.t().contiguous()
    want_cpu = _fma_chain(x, b_cpu, bias=bias)
    x, b, bias = x.cuda(), b_cpu.cuda(), bias.cuda()
    configs = GPU_FMA_CONFIGS + [c for c in all_configs(torch.float32) if c.fma_vec and c not in GPU_FMA_CONFIGS]
    bad = []
    for m in (1, 4, 16, 31):
        dot = triton_gemm(x[:m], b, bias=bias, config=DOT_CONFIG)
        if not torch.equal(dot.cpu(), want_cpu[:m]):
            bad.append(("dot-vs-oracle", m, int((dot.cpu() != want_cpu[:m]).sum())))
        for cfg in configs:
            got = triton_gemm(x[:m], b, bias=bias, config=cfg)
            if not torch.equal(got, dot):
                bad.append((cfg.short(), m, int((got != dot).sum())))
    assert not bad, f"off the IEEE dot kernel's bits: {bad[:12]}"
