"""TMA tile loads (gemm.tma): the same canonical K-chain as the pointer kernel.

CPU: the kernel's logic under TRITON_INTERPRET=1 (fp16 bitwise against the pointer
kernel with one-row tiles; fp32 against float64, since the interpreter's numpy dot
rounds by memory layout), and which layouts TMA may describe. GPU: every TMA config the
tables can pick gives the pointer kernel's bits on every layout the library uses.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rlkernels.gemm import table as gemm_table

from rlkernels.gemm import triton as gemm

from rlkernels.ops import linear_logprob as lp_mod
from rlkernels.ops.lm_head.config import FUSED_16BIT
from rlkernels.gemm.table import GemmConfig
from rlkernels.gemm.triton import triton_gemm
from rlkernels.gemm.tma import tma_gemm, tma_layout_ok

from ..conftest import interpreter_only, randn


# One row per program (the interpreter's numpy dot rounds a row by its place in the
# tile, see gemm.table); a persistent schedule with 4 programs walking the tiles.
ONE_ROW = dict(block_m=1, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=1)


def _pointer(cfg: GemmConfig) -> GemmConfig:
    return dataclasses.replace(cfg, tma=False, persistent=False, warp_specialize=False)


def test_layout_rules():
    x = torch.empty(64, 40, dtype=torch.float16)
    assert tma_layout_ok(x) and tma_layout_ok(x.t(), 0)
    assert not tma_layout_ok(x.t())  # inner stride 40
    assert not tma_layout_ok(x[:, 1:])  # base off 16 bytes
    assert not tma_layout_ok(torch.empty(8, 13, dtype=torch.float16))  # 26-byte rows
    assert tma_layout_ok(torch.empty(8, 4, dtype=torch.float32))  # 16-byte rows
    assert not tma_layout_ok(torch.empty(2, 3, 8, dtype=torch.float16))  # 2-D only


@interpreter_only
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 8, 8), (13, 40, 72), (37, 24, 40)])
def test_fp16_bits_equal_pointer_kernel(m, n, k, persistent, gen):
    cfg = GemmConfig(**ONE_ROW, tma=True, persistent=persistent)
    x = randn(m, k, dtype=torch.float16, generator=gen)
    w = randn(n, k, dtype=torch.float16, generator=gen, scale=k ** -0.5)
    bias = randn(n, dtype=torch.float16, generator=gen)
    want = triton_gemm(x, w.t(), bias=bias, config=_pointer(cfg))
    assert torch.equal(tma_gemm(x, w.t(), cfg, bias=bias), want)
    # N-major B ([K, N] rows) and an fp32 output chained from its current value.
    b_kn = w.t().contiguous()
    start = randn(m, n, generator=gen)
    want_acc = triton_gemm(x, b_kn, out=start.clone(), accumulate=True, config=_pointer(cfg))
    assert torch.equal(tma_gemm(x, b_kn, cfg, out=start.clone(), accumulate=True), want_acc)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_token_reduction_layout(dtype, gen):
    """dW = dY^T @ X: A read M-major (the transpose of a [tokens, N] tensor)."""
    tokens, n, k = 48, 24, 40
    dy = randn(tokens, n, dtype=dtype, generator=gen)
    x = randn(tokens, k, dtype=dtype, generator=gen)
    # An M-major tile's inner dimension is BLOCK_M: TMA wants at least 16 bytes there.
    cfg = GemmConfig(**{**ONE_ROW, "block_m": 16}, tma=True, persistent=True)
    got = tma_gemm(dy.t(), x, cfg, out_dtype=torch.float32)
    want = dy.double().t() @ x.double()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max() * (1 if dtype == torch.float32 else 2)


@interpreter_only
def test_fp32_accuracy_and_k_tail(gen):
    """K = 40 is not a multiple of BLOCK_K = 16: the zero-filled tail adds nothing."""
    x = randn(9, 40, generator=gen)
    w = randn(24, 40, generator=gen)
    cfg = GemmConfig(**ONE_ROW, tma=True)
    got = tma_gemm(x, w.t(), cfg)
    want = x.double() @ w.double().t()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


# ---------------------------------------------------------------------------------------
# GPU: the configs the tables pick, on the layouts the library calls them with.
# ---------------------------------------------------------------------------------------

def _tma_configs(dtype: torch.dtype) -> list[GemmConfig]:
    return [cfg for cfg in gemm_table.all_configs(dtype) if cfg.tma]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", [(4096, 4096), (1000, 1000), (4096, 8192)])
def test_gpu_tma_configs_give_pointer_bits(dtype, k, n):
    assert _tma_configs(dtype), "the table has no TMA config to prove"
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(2053, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=g).to(dtype)
    dy = torch.randn(2053, n, device="cuda", generator=g).to(dtype)
    start = torch.randn(n, k, device="cuda", generator=g)
    bad = []
    for cfg in _tma_configs(dtype):
        ptr = _pointer(cfg)
        for m in (1, 17, 300, 2053):
            if not torch.equal(triton_gemm(x[:m], w.t(), bias=bias, config=cfg),
                               triton_gemm(x[:m], w.t(), bias=bias, config=ptr)):
                bad.append((cfg.short(), "forward", m))
            # dW = dY^T X from zero (16-bit out) and chained into an fp32 main_grad.
            if not torch.equal(triton_gemm(dy[:m].t(), x[:m], config=cfg),
                               triton_gemm(dy[:m].t(), x[:m], config=ptr)):
                bad.append((cfg.short(), "dW", m))
            got = triton_gemm(dy[:m].t(), x[:m], out=start.clone(), accumulate=True, config=cfg)
            want = triton_gemm(dy[:m].t(), x[:m], out=start.clone(), accumulate=True, config=ptr)
            if not torch.equal(got, want):
                bad.append((cfg.short(), "dW+=", m))
        # [K, N]-row B (linear_logprob's dH = g @ W[chunk]) into an fp32 accumulator.
        acc = torch.randn(300, k, device="cuda", generator=g)
        got = triton_gemm(dy[:300], w, out=acc.clone(), accumulate=True, config=cfg)
        if not torch.equal(got, triton_gemm(dy[:300], w, out=acc.clone(), accumulate=True, config=ptr)):
            bad.append((cfg.short(), "dH+=", 300))
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize("v", [32003, 151936])
def test_gpu_logprob_tma_and_persistent_give_pointer_bits(v):
    n, d = 1000, 4096
    g = torch.Generator(device="cuda").manual_seed(12)
    h = torch.randn(n, d, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, d, device="cuda", generator=g) / d ** 0.5).to(torch.bfloat16)
    b = torch.randn(v, device="cuda", generator=g).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::9] = -1
    gl, ge = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    base = dataclasses.replace(FUSED_16BIT, tma=False, persistent=False)
    want = lp_mod.TritonLinearLogprobBackend(base).forward(h, w, b, t, 0.7)
    g_want = torch.empty(n, 4096, device="cuda", dtype=torch.bfloat16)
    lp_mod.TritonLinearLogprobBackend(base).grad_logits(h, w, b, t, want[2], want[1], gl, ge, 0.7, 1024, 1024 + 4096,
                                                        g_want)
    for cfg in (dataclasses.replace(base, tma=True), dataclasses.replace(base, tma=True, persistent=True),
                dataclasses.replace(base, tma=True, persistent=True, tma_store=not base.tma_store),
                FUSED_16BIT):
        k = lp_mod.TritonLinearLogprobBackend(cfg)
        got = k.forward(h, w, b, t, 0.7)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), cfg.short()
        g_got = torch.empty_like(g_want)
        k.grad_logits(h, w, b, t, want[2], want[1], gl, ge, 0.7, 1024, 1024 + 4096, g_got)
        assert torch.equal(g_got, g_want), cfg.short()
