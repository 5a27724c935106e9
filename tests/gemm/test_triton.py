"""The GEMM dispatch table (gemm.table) and the fp32 swapped orientation.

CPU: the table's rules (pure functions of M, N, dtype and operand layout) and, under
TRITON_INTERPRET=1, the swapped kernel's arithmetic against float64 (the interpreter's
numpy dot rounds by memory layout, so bits are a GPU property: tests/ops/test_matmul.py
proves every fp32 config, swapped or not, gives the same bits).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rlkernels.gemm import table as gemm_table

from rlkernels import contract
from rlkernels.runtime import launcher as _launch
from rlkernels.kernels import _triton
from rlkernels.gemm import triton as gemm
from rlkernels.gemm.table import GemmConfig, gemm_config, swappable
from rlkernels.gemm.triton import triton_gemm
from rlkernels._env import triton_interpret

from ..conftest import interpreter_only, randn


SWAP_TILE = GemmConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=1, swap_ab=True)


def _ref(x, w, bias=None, start=None):
    out = x.double() @ w.double().t()
    if start is not None:
        out = out + start.double()
    return out if bias is None else out + bias.double()


def test_swap_only_for_2d_operands_with_k_contiguous_b():
    x, w = torch.empty(5, 8), torch.empty(7, 8)
    assert swappable(x, w.t())  # an nn.Linear weight read as B = W^T
    assert not swappable(x, w.t().contiguous())  # row-major B: lanes already read rows
    assert not swappable(x.expand(2, 5, 8), w.t())  # batch axis
    assert not swappable(x, w.t(), rowsum=torch.empty(5))  # the fused row-sum


@pytest.mark.skipif(triton_interpret(), reason="the interpreter has its own one-row config")
def test_fp32_table_rows():
    for m, n in [(1, 4096), (1, 151936), (2, 12288), (3, 4096), (4, 151936), (5, 4096), (8, 4096), (9, 4096),
                 (16, 12288), (64, 151936), (100, 4096), (9999, 4096)]:
        swapped = gemm_config(m, n, torch.float32)
        plain = gemm_config(m, n, torch.float32, swappable=False)
        assert not plain.swap_ab
        # One row stays a weight stream in the forward orientation; a few rows swap on wide
        # outputs (one 16-token tile) and from M = 5 on narrower ones.
        assert swapped.swap_ab == (m > 1 and (n >= gemm_table.WIDE_N or m > 4)), (m, n, swapped.short())
    # 16-bit tables never swap (the tensor cores read both operands from swizzled shared memory).
    assert not any(cfg.swap_ab for cfg in gemm_table.all_configs(torch.bfloat16))
    assert {c for _, _, c in gemm_table.GEMM_TABLE_FP32 + gemm_table.GEMM_TABLE_FP32_UNSWAPPED} == set(
        gemm_table.all_configs(torch.float32))


@pytest.mark.skipif(triton_interpret(), reason="the interpreter has its own one-row config")
def test_old_triton_gets_16_row_tiles(monkeypatch):
    monkeypatch.setattr(gemm_table, "DOT_ANY_M", False)
    cfg = gemm_config(1, 4096, torch.float32)
    assert cfg.block_m == 16
    monkeypatch.setattr(gemm_table, "DOT_ANY_M", True)
    assert gemm_config(1, 4096, torch.float32).block_m == 1


def test_triton_version_rule():
    # Whatever is installed, the flag is a pure function of the version string.
    if _triton.triton is None:
        assert _triton.DOT_ANY_M is False
    else:
        major, minor = (int(p) for p in _triton.triton.__version__.split(".")[:2])
        assert _triton.DOT_ANY_M == ((major, minor) >= (3, 5))


@interpreter_only
@pytest.mark.parametrize("m,k,n", [(1, 16, 16), (5, 70, 37), (17, 33, 48), (40, 48, 23)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_swapped_orientation_accuracy(m, k, n, with_bias, gen):
    x = randn(m, k, generator=gen)
    w = randn(n, k, generator=gen, scale=k ** -0.5)
    bias = randn(n, generator=gen) if with_bias else None
    out = triton_gemm(x, w.t(), bias=bias, config=SWAP_TILE)
    assert out.shape == (m, n) and out.is_contiguous()
    contract.check("matmul", torch.float32, out, _ref(x, w, bias))


@interpreter_only
def test_swapped_orientation_strided_input_accumulate_and_out_dtype(gen):
    m, k, n = 19, 40, 29
    x = randn(m, 2 * k, generator=gen)[:, ::2]  # a strided activation is made contiguous as X^T
    w = randn(n, k, generator=gen, scale=k ** -0.5)
    bias = randn(n, generator=gen)
    start = randn(m, n, generator=gen)
    out = start.clone()
    got = triton_gemm(x, w.t(), bias=bias, out=out, accumulate=True, config=SWAP_TILE)
    assert got is out
    contract.check("matmul", torch.float32, out, _ref(x, w, bias, start))
    # A preallocated transposed output is written through its strides.
    out_t = torch.full((n, m), float("nan")).t()
    triton_gemm(x, w.t(), out=out_t, config=SWAP_TILE)
    contract.check("matmul", torch.float32, out_t, _ref(x, w))
    half = triton_gemm(x, w.t(), out_dtype=torch.float16, config=SWAP_TILE)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), _ref(x, w).float(), atol=2e-2, rtol=2e-2)


@interpreter_only
def test_swapped_orientation_refuses_operands_it_cannot_swap(gen):
    x = randn(4, 32, generator=gen)
    w = randn(16, 32, generator=gen)
    with pytest.raises(ValueError, match="k-contiguous"):
        triton_gemm(x, w.t().contiguous(), config=SWAP_TILE)
    with pytest.raises(ValueError, match="k-contiguous"):
        triton_gemm(x.half(), w.t().half(), config=SWAP_TILE)


@interpreter_only
def test_swapped_and_forward_orientation_agree_to_rounding(gen):
    x = randn(23, 64, generator=gen)
    w = randn(31, 64, generator=gen, scale=0.125)
    fwd = triton_gemm(x, w.t(), config=dataclasses.replace(SWAP_TILE, block_m=1, swap_ab=False))
    swp = triton_gemm(x, w.t(), config=SWAP_TILE)
    torch.testing.assert_close(swp, fwd, atol=1e-5, rtol=1e-5)


SHORT_TILE = GemmConfig(16, 32, 16, group_m=1, num_warps=4, num_stages=1)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 48), (3, 40), (15, 33)])
def test_rows_past_m_are_masked_not_read(dtype, m, k, gen, monkeypatch):
    # Fewer rows than the tile: rows past M are masked (zeros) instead of re-reading rows
    # 0..M-1. A stored row's products are its own, so its bits are those it gets inside a
    # full tile of real rows; K = 33 and 40 take the k-masked loop too. Rows past M lie in
    # a poisoned buffer: a masked load never touches them.
    n = 45
    buf = torch.full((16, k), float("nan")).to(dtype)
    buf[:m] = randn(m, k, generator=gen).to(dtype)
    x = buf[:m]
    w = randn(n, k, generator=gen, scale=k ** -0.5).to(dtype)
    bias = randn(n, generator=gen).to(dtype)
    masked = triton_gemm(x, w.t(), bias=bias, config=SHORT_TILE)
    rel = ((masked.double() - _ref(x, w, bias)).norm() / _ref(x, w, bias).norm()).item()
    assert rel <= contract.CONTRACT["matmul"][dtype].tolerance, rel
    start = randn(m, n, generator=gen)
    acc = triton_gemm(x, w.t(), out=start.clone(), accumulate=True, config=SHORT_TILE)
    assert torch.allclose(acc.double(), _ref(x, w, start=start), rtol=1e-3, atol=1e-3)
    full = torch.cat([x, randn(16 - m, k, generator=gen).to(dtype)])  # a whole tile: nothing masked
    assert torch.equal(masked, triton_gemm(full, w.t(), bias=bias, config=SHORT_TILE)[:m])


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(1, 48, 45), (7, 33, 64), (17, 40, 3)])
def test_weight_given_transposed_reads_like_its_view(dtype, m, k, n, gen):
    # rlkernels.linear hands the [N, K] weight over as is (b_transposed) instead of a
    # B = W^T view per call; the kernel must read the same elements. The weight is a
    # strided slice of a larger buffer, so its strides are not the contiguous ones.
    x = randn(m, k, generator=gen).to(dtype)
    w_buf = randn(n + 5, k + 7, generator=gen, scale=k ** -0.5).to(dtype)
    w = w_buf[2:n + 2, 3:k + 3]
    bias = randn(n, generator=gen).to(dtype)
    want = triton_gemm(x, w.t(), bias=bias)
    assert torch.equal(triton_gemm(x, w, bias=bias, b_transposed=True), want)
    x3 = randn(3, m, k, generator=gen).to(dtype)  # a batch sharing the weight
    assert torch.equal(triton_gemm(x3, w, b_transposed=True), triton_gemm(x3, w.t()))
    rel = ((want.double() - _ref(x, w, bias)).norm() / _ref(x, w, bias).norm()).item()
    assert rel <= contract.CONTRACT["matmul"][dtype].tolerance, rel


def test_b_transposed_needs_a_2d_weight():
    with pytest.raises(ValueError, match="b_transposed"):
        triton_gemm(torch.empty(2, 3, 4), torch.empty(2, 5, 4), b_transposed=True)


def test_gemm_backends_take_the_weight_transposed(gen):
    from rlkernels.gemm.backends import TorchGemmBackend

    x = randn(5, 12, generator=gen)
    w = randn(7, 12, generator=gen)
    gemm_backend = TorchGemmBackend()
    assert torch.equal(gemm_backend.gemm(x, w, b_transposed=True), gemm_backend.gemm(x, w.t()))


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_launch_plan_gives_the_full_paths_result(dtype, gen, monkeypatch):
    # A repeated 2-D forward call launches from its plan; the result must be the one the
    # full path gives (an explicit config skips the plans) for new tensors of the same
    # shapes, with or without bias, weight as [N, K] or [K, N], strided, another out dtype.
    monkeypatch.setattr(gemm, "_PLANS", {})
    m, k, n = 7, 40, 37
    cases = [
        (lambda: randn(m, k, generator=gen).to(dtype), lambda: randn(k, n, generator=gen).to(dtype), {}),
        (lambda: randn(m, k, generator=gen).to(dtype), lambda: randn(n, k, generator=gen).to(dtype),
         {"b_transposed": True, "bias": randn(n, generator=gen).to(dtype)}),
        (lambda: randn(m, k + 3, generator=gen).to(dtype)[:, 3:], lambda: randn(k, n, generator=gen).to(dtype),
         {"out_dtype": torch.float32}),
    ]
    for make_a, make_b, kw in cases:
        for _ in range(3):
            a, b = make_a(), make_b()
            b_kn = b.t() if kw.get("b_transposed") else b
            cfg = gemm_config(m, n, dtype, swappable=swappable(a, b_kn))
            full = {key: v for key, v in kw.items() if key != "b_transposed"}
            want = triton_gemm(a, b_kn, config=cfg, **full)
            assert torch.equal(triton_gemm(a, b, **kw), want)
    assert len(gemm._PLANS) == len(cases)


@interpreter_only
@pytest.mark.parametrize("m", [7, 16])  # A^T padded to a whole token tile, or not
def test_swapped_fp32_launch_plan_gives_the_full_paths_result(m, gen, monkeypatch):
    # An fp32 call on a swapped tile keeps a plan too: a hit copies the new A^T into the
    # same padded layout and launches the same kernel; with or without bias, weight as
    # [N, K] or as its k-contiguous [K, N] view, a strided activation.
    monkeypatch.setattr(gemm, "_PLANS", {})
    k, n = 40, 37
    monkeypatch.setattr(gemm, "gemm_config", lambda *a, **kw: SWAP_TILE)
    cases = [({"b_transposed": True}, lambda w: w), ({"b_transposed": True, "bias": True}, lambda w: w),
             ({}, lambda w: w.t())]
    for kw, given in cases:
        bias = randn(n, generator=gen) if kw.get("bias") else None
        for i in range(3):
            x = randn(m, k + 3, generator=gen)[:, 3:] if i == 2 else randn(m, k, generator=gen)
            w = randn(n, k, generator=gen, scale=k ** -0.5)
            got = triton_gemm(x, given(w), bias=bias, b_transposed=bool(kw.get("b_transposed")))
            assert got.shape == (m, n) and got.is_contiguous()
            assert torch.equal(got, triton_gemm(x, w.t(), bias=bias, config=SWAP_TILE))
    plans = list(gemm._PLANS.values())
    # One plan per layout (the strided activation is a third per case), each swapped.
    assert len(plans) == 2 * len(cases) and all(p.swap_block == SWAP_TILE.block_n for p in plans)
    # A hit works nothing out again.
    monkeypatch.setattr(gemm, "gemm_config", lambda *a, **kw: pytest.fail("a plan hit chose a tile"))
    x, w = randn(m, k, generator=gen), randn(n, k, generator=gen)
    assert torch.equal(triton_gemm(x, w, b_transposed=True), triton_gemm(x, w.t(), config=SWAP_TILE))


@interpreter_only
def test_launch_plan_skips_the_tile_choice_and_keys_what_the_launch_depends_on(gen, monkeypatch):
    monkeypatch.setattr(gemm, "_PLANS", {})
    x, w = randn(5, 32, generator=gen).half(), randn(24, 32, generator=gen).half()
    want = triton_gemm(x, w, b_transposed=True)
    # A hit works nothing out again: the table is not consulted.
    monkeypatch.setattr(gemm, "gemm_config", lambda *a, **k: pytest.fail("a plan hit chose a tile"))
    assert torch.equal(triton_gemm(x.clone(), w.clone(), b_transposed=True), want)
    monkeypatch.undo()
    monkeypatch.setattr(gemm, "_PLANS", {})
    triton_gemm(x, w, b_transposed=True)
    keys = {gemm.plan_key(x, w, None, None, True)}
    # Misaligned pointers (Triton specializes on 16-byte alignment), bias, the out dtype
    # and the orientation each make another plan.
    buf = randn(5 * 32 + 1, generator=gen).half()
    x_odd = buf[1:].view(5, 32)
    variants = [(x_odd, w, None, None, True), (x, w, randn(24, generator=gen).half(), None, True),
                (x, w, None, torch.float32, True), (x, w.t().contiguous(), None, None, False)]
    for a, b, bias, out_dtype, bt in variants:
        keys.add(gemm.plan_key(a, b, bias, out_dtype, bt))
        b_kn = b.t() if bt else b
        got = triton_gemm(a, b, bias=bias, out_dtype=out_dtype, b_transposed=bt)
        want_v = triton_gemm(a, b_kn, bias=bias, out_dtype=out_dtype,
                             config=gemm_config(5, 24, torch.float16))
        assert torch.equal(got, want_v)
    assert len(keys) == 5 and set(gemm._PLANS) <= keys and len(gemm._PLANS) == 5


@interpreter_only
def test_launch_plans_are_bounded(gen, monkeypatch):
    monkeypatch.setattr(gemm, "_PLANS", {})
    monkeypatch.setattr(gemm, "MAX_PLANS", 3)
    w = randn(8, 16, generator=gen).half()
    for m in range(1, 9):  # one plan per problem shape
        x = randn(m, 16, generator=gen).half()
        assert torch.equal(triton_gemm(x, w, b_transposed=True),
                           triton_gemm(x, w.t(), config=gemm_config(m, 8, torch.float16)))
        assert 0 < len(gemm._PLANS) <= 3


@interpreter_only
def test_launch_plan_after_a_tma_variant_that_did_not_fit(gen, monkeypatch):
    # A TMA tile whose variant does not fit in shared memory runs the pointer kernel with the
    # same tile (the weight read through its [K, N] view); its plan must land under the
    # call's own plan key.
    monkeypatch.setattr(gemm, "_PLANS", {})
    monkeypatch.setattr(gemm, "_TMA_TOO_BIG", set())
    tma_tile = GemmConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=1, tma=True)
    monkeypatch.setattr(gemm, "gemm_config", lambda *args, **kwargs: tma_tile)

    def too_big(*args, **kwargs):
        raise gemm.OutOfResources(300_000, 232_448, "shared memory")

    monkeypatch.setattr(gemm, "tma_gemm_planned", too_big)
    monkeypatch.setattr(gemm, "tma_layouts", lambda a, b, out: (True, True, True))  # (a Hopper's answer)
    x, w = randn(5, 32, generator=gen).half(), randn(24, 32, generator=gen).half()
    first = triton_gemm(x, w, b_transposed=True)
    assert set(gemm._PLANS) == {gemm.plan_key(x, w, None, None, True)} and len(gemm._TMA_TOO_BIG) == 1
    assert torch.equal(triton_gemm(x.clone(), w.clone(), b_transposed=True), first)
    rel = ((first.double() - _ref(x, w)).norm() / _ref(x, w).norm()).item()
    assert rel <= contract.CONTRACT["matmul"][torch.float16].tolerance, rel


class _RecordingTmaLauncher(_launch.CachedLauncher):
    """Stands in for gemm_tma._launch_tma on the CPU (the TMA kernel needs a Hopper): each
    launch is recorded as what it hands the kernel -- descriptors as (base, shape, strides,
    block), the output by its shape and strides, other tensors by address -- and writes
    the product into the output so that the caller's result can be checked."""

    def __init__(self) -> None:
        from rlkernels.gemm import tma as gemm_tma

        super().__init__(fn=gemm_tma.gemm_tma_kernel)  # (its declared constexpr names)
        self.enabled, self.launches = True, []

    def key(self, args, constexprs, num_warps, num_stages):
        return ("tma", constexprs, num_warps, num_stages)

    def _launch(self, key, grid, args, constexprs, num_warps, num_stages, stream):
        a_desc, b_desc, c_desc, out, bias = args[:5]
        # (descriptors lie over the operands' own memory: base is A [M, K], B [K, N])
        out.copy_(a_desc.base.double() @ b_desc.base.double() + (bias.double() if constexprs[0] else 0))

        def describe(t):
            if t is out:
                return ("out", tuple(t.shape), t.stride())
            if isinstance(t, torch.Tensor):
                return t.data_ptr()
            if hasattr(t, "block_shape"):
                return ("out" if t.base is out else t.base.data_ptr(), tuple(t.shape), tuple(t.strides),
                        tuple(t.block_shape))
            return t

        self.launches.append((key, grid, tuple(describe(t) for t in args), constexprs, num_warps, num_stages))


@pytest.mark.parametrize("with_bias", [False, True])
def test_tma_launch_plan_launches_what_the_full_path_launches(gen, monkeypatch, with_bias):
    # A repeated 2-D forward call on a TMA tile launches from its plan: the same grid,
    # constexprs, launcher key and integer arguments, and descriptors over the new call's
    # own tensors exactly as tma_gemm builds them.
    from rlkernels.gemm import tma as gemm_tma

    tile = GemmConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=1, tma=True, persistent=True)
    launcher = _RecordingTmaLauncher()
    monkeypatch.setattr(gemm_tma, "_launch_tma", launcher)
    monkeypatch.setattr(gemm, "_PLANS", {})
    monkeypatch.setattr(gemm, "_TMA_TOO_BIG", set())
    monkeypatch.setattr(gemm, "gemm_config", lambda *args, **kwargs: tile)
    # (a Hopper's answer, from the operands' strides: tma_layouts itself wants CUDA tensors)
    monkeypatch.setattr(gemm, "tma_layouts", lambda a, b, out: (gemm_tma.tma_layout_ok(a, 1),
                                                                gemm_tma.tma_layout_ok(b, 0), True))
    m, k, n = 37, 48, 40
    bias = randn(n, generator=gen).half() if with_bias else None
    calls = [(randn(m, k, generator=gen).half(), randn(n, k, generator=gen).half()) for _ in range(3)]
    for i, (x, w) in enumerate(calls):
        got = triton_gemm(x, w, bias=bias, b_transposed=True)
        assert torch.equal(got, (_ref(x, w, bias)).half())
        assert len(gemm._PLANS) == 1 and isinstance(next(iter(gemm._PLANS.values())), gemm_tma.TmaPlan)
        if i == 0:
            # Plan hits work nothing out again: neither the tile nor the layouts.
            monkeypatch.setattr(gemm, "gemm_config", lambda *a, **kw: pytest.fail("a plan hit chose a tile"))
            monkeypatch.setattr(gemm, "tma_layouts", lambda *a: pytest.fail("a plan hit checked layouts"))
    planned = launcher.launches[1:]
    assert len(planned) == 2 and all(launch[0] == launcher.launches[0][0] for launch in planned)
    for (x, w), launch in zip(calls[1:], planned):
        full = gemm_tma.tma_gemm(x, w.t(), tile, bias=bias, layouts=(True, True, True))
        assert torch.equal(full, (_ref(x, w, bias)).half())
        assert launch[1:] == launcher.launches[-1][1:]


@pytest.mark.skipif(triton_interpret(), reason="the interpreter has its own one-row config")
def test_gated_gemm_tile_is_the_pairs_width_halved_and_only_at_decode_sizes():
    from rlkernels.gemm.table import SILU_MUL_MAX_M, silu_mul_config

    for m in (1, 7, SILU_MUL_MAX_M):
        for n in (1024, 6144, 12288):
            cfg, pair = silu_mul_config(m, n, torch.bfloat16), gemm_config(m, 2 * n, torch.bfloat16)
            assert dataclasses.replace(cfg, block_n=pair.block_n) == pair
            assert cfg.block_n == max(16, pair.block_n // 2) and not cfg.tma and not cfg.swap_ab
    assert silu_mul_config(SILU_MUL_MAX_M + 1, 6144, torch.bfloat16) is None
    assert silu_mul_config(4, 6144, torch.float32) is None  # tl.dot on fp32 is not the IEEE chain


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(1, 48, 45), (7, 33, 64), (17, 40, 3), (3, 16, 1)])
def test_gated_gemm_is_two_chains_and_the_silu_mul_kernel(dtype, m, k, n, gen):
    from rlkernels.kernels.activations import silu_mul_kernel

    x = randn(m + 2, 2 * k, generator=gen, scale=2.0).to(dtype)[1:m + 1, ::2]  # strided rows and columns
    w_gate = randn(n, k, generator=gen, scale=3.0 / k ** 0.5).to(dtype)
    w_up = randn(n, k, generator=gen, scale=1.0 / k ** 0.5).to(dtype)
    out = gemm.triton_gemm_silu_mul(x, w_gate, w_up)
    gate = triton_gemm(x, w_gate, b_transposed=True)
    up = triton_gemm(x, w_up, b_transposed=True)
    ref = torch.empty_like(gate)
    silu_mul_kernel[(1,)](gate, up, ref, gate.numel(), BLOCK=triton_pow2(gate.numel()))
    assert out.shape == (m, n) and out.dtype == dtype
    assert torch.equal(out.view(torch.int16 if dtype == torch.float16 else torch.int32),
                       ref.view(torch.int16 if dtype == torch.float16 else torch.int32))


def triton_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@pytest.mark.skipif(triton_interpret(), reason="the interpreter has its own one-row config")
def test_grouped_gemm_tile_is_the_groups_width_and_only_at_decode_sizes():
    from rlkernels.gemm.table import LINEAR_GROUP_MAX_M, linear_group_config

    for m in (1, 7, LINEAR_GROUP_MAX_M):
        for n in (1024, 4096, 6144, 12288):
            assert linear_group_config(m, n, torch.bfloat16) == gemm_config(m, n, torch.bfloat16)
    assert linear_group_config(LINEAR_GROUP_MAX_M + 1, 4096, torch.bfloat16) is None
    assert linear_group_config(4, 4096, torch.float32) is None  # tl.dot on fp32 is not the IEEE chain


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,k,ns", [(1, 48, (45, 13, 13)), (7, 33, (64, 1)), (3, 16, (5,))])
def test_grouped_gemm_is_each_weights_own_chain(dtype, m, k, ns, gen):
    x = randn(m + 2, 2 * k, generator=gen, scale=2.0).to(dtype)[1:m + 1, ::2]  # strided rows and columns
    weights = tuple(randn(n, k, generator=gen, scale=1.0 / k ** 0.5).to(dtype) for n in ns)
    outs = gemm.triton_gemm_group(x, weights)
    view = torch.int16 if dtype == torch.float16 else torch.int32
    assert len(outs) == len(ns)
    for out, w in zip(outs, weights):
        ref = triton_gemm(x, w, b_transposed=True)
        assert out.shape == (m, w.shape[0]) and out.dtype == dtype and out.is_contiguous()
        assert torch.equal(out.view(view), ref.view(view))


def test_grouped_gemm_refuses_more_members_than_the_kernel_has():
    with pytest.raises(ValueError, match="1 to 3 weights"):
        gemm.triton_gemm_group(torch.empty(2, 8), tuple(torch.empty(4, 8) for _ in range(4)))


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(1, 48, 45), (7, 33, 64)])
def test_grouped_gemm_residual_is_the_add_after_the_chain(dtype, m, k, n, gen):
    x = randn(m, k, generator=gen, scale=2.0).to(dtype)
    w = randn(n, k, generator=gen, scale=1.0 / k ** 0.5).to(dtype)
    residual = randn(m, n, generator=gen, scale=8.0).to(dtype)
    (out,) = gemm.triton_gemm_group(x, (w,), residual=residual)
    ref = residual + triton_gemm(x, w, b_transposed=True)
    view = torch.int16 if dtype == torch.float16 else torch.int32
    assert torch.equal(out.view(view), ref.view(view))
    with pytest.raises(ValueError, match="residual to one weight"):
        gemm.triton_gemm_group(x, (w, w), residual=residual)
