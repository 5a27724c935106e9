"""The grouped GEMM over experts: every sorted slot's row has the bits of ``rlkernels.linear``
on its token row alone with its expert's weight; the fused silu * up has the unfused
path's bits; the grouped weight gradient has the per-expert dW calls' bits (rounded, and
chained into main_grad); ``moe_experts`` on the grouped kernels equals the per-expert
loop, forward and backward (dh and dX through the transposed weight views, dW grouped)."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import rlkernels
from rlkernels.gemm.grouped import grouped_gemm, grouped_wgrad, max_row_tiles
from rlkernels.gemm.table import GemmConfig
from rlkernels.ops import moe as moe_ops

from ..conftest import HAS_CUDA, interpreter_only

# A multi-row tile for the interpreter (its patched dot sums each element alone, in k
# order, so any BLOCK_M gives the bits of BLOCK_M = 1): rows past an expert's end masked.
WIDE_ROWS = GemmConfig(4, 16, 16, group_m=1, num_warps=4, num_stages=1)


def _case(T, E, k, H, N, dtype, device="cpu", seed=0, crowd=None):
    """x [T, H], weights [E, N, H], index [T, k]: k distinct experts per token from the
    first half of the experts (the rest get none); ``crowd``: every token's rank 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w = (torch.randn(E, N, H, generator=g) / H ** 0.5).to(device, dtype)
    pool = max(k, E // 2)
    index = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    index = index.long()
    if crowd is not None and T:
        for t in range(T):
            row = [crowd] + [e for e in index[t].tolist() if e != crowd][:k - 1]
            index[t] = torch.tensor(row)
    return x, w, index.to(device)


def _grouped(x, w, index, config=None, **kw):
    routing = moe_ops._Routing(index, w.shape[0], "test")
    out, gu = grouped_gemm(x, w, routing.slot_end, routing.slots, a_rows=routing.order // index.shape[1],
                           config=config, **kw)
    return routing, out, gu


def _assert_rows_are_linear_alone(x, w, index, out, routing, backend="triton"):
    k = index.shape[1]
    flat = index.reshape(-1)
    for s, slot in enumerate(routing.order.tolist()):
        t, e = slot // k, int(flat[slot])
        alone = rlkernels.linear(x[t:t + 1], w[e], backend=backend)[0]
        assert torch.equal(out[s], alone), (s, t, e)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [None, WIDE_ROWS], ids=["interp_tile", "4x16x16"])
@pytest.mark.parametrize("T, E, k, H, N, crowd", [
    (7, 6, 3, 40, 24, None),    # T prime, half the experts empty, H and N not multiples of the tile
    (5, 4, 1, 19, 33, 2),       # top-1, one expert receives every token
    (11, 9, 3, 33, 17, 4),      # one expert crowded (all 11 tokens), the others sparse
])
def test_every_slot_is_linear_of_its_row_alone(dtype, config, T, E, k, H, N, crowd):
    x, w, index = _case(T, E, k, H, N, dtype, crowd=crowd)
    routing, out, _ = _grouped(x, w, index, config)
    assert out.shape == (T * k, N)
    _assert_rows_are_linear_alone(x, w, index, out, routing)
    if crowd is not None:
        assert routing.counts[crowd] == T and 0 in routing.counts


@interpreter_only
def test_fp32_output_and_scatter_to_slots():
    x, w, index = _case(6, 5, 2, 24, 20, torch.float16, seed=3)
    routing = moe_ops._Routing(index, 5, "test")
    rows = x.index_select(0, routing.order // 2)
    out, _ = grouped_gemm(rows, w, routing.slot_end, routing.slots, c_rows=routing.order, out_dtype=torch.float32,
                          config=WIDE_ROWS)
    flat = index.reshape(-1)
    for slot in range(12):
        alone = rlkernels.linear(x[slot // 2:slot // 2 + 1], w[int(flat[slot])], out_dtype=torch.float32,
                                 backend="triton")[0]
        assert torch.equal(out[slot], alone), slot


@interpreter_only
def test_no_slots():
    x, w, index = _case(0, 4, 2, 16, 8, torch.float32)
    _, out, _ = _grouped(x, w, index)
    assert out.shape == (0, 8)


def test_the_grid_bound_covers_every_split():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        E = int(torch.randint(1, 20, (1,), generator=g))
        counts = torch.randint(0, 9, (E,), generator=g) * torch.randint(0, 2, (E,), generator=g)
        for bm in (1, 4, 16):
            need = int(((counts + bm - 1) // bm).sum())
            assert need <= max_row_tiles(int(counts.sum()), E, bm)


def _silu_up_interpreted(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The fused epilogue's formula with the interpreter's arithmetic (numpy's exp, fp32)."""
    gf = g.float().numpy()
    s = torch.from_numpy((gf / (np.float32(1) + np.exp(-gf))).astype(np.float32)).to(g.dtype)
    return (s.float() * u.float()).to(g.dtype)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_silu_up_is_the_unfused_formula(dtype):
    I = 13  # noqa: E741 - the expert width
    x, w, index = _case(9, 6, 3, 21, 2 * I, dtype, seed=5)
    routing, gu, _ = _grouped(x, w, index, WIDE_ROWS)
    _, h, gu_kept = _grouped(x, w, index, WIDE_ROWS, silu_up=True, keep_gate_up=True)
    assert h.shape == (27, I) and torch.equal(gu_kept, gu)
    assert torch.equal(h, _silu_up_interpreted(gu[:, :I], gu[:, I:]))
    _, h_only, none = _grouped(x, w, index, WIDE_ROWS, silu_up=True)
    assert none is None and torch.equal(h_only, h)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("keep", [False, True])
def test_moe_experts_grouped_equals_the_per_expert_loop(dtype, keep):
    from rlkernels.gemm.backends import TritonGemmBackend
    H, I, E, k, T = 24, 12, 7, 3, 11  # noqa: E741
    x, gate_up, index = _case(T, E, k, H, 2 * I, dtype, seed=7, crowd=1)
    down = (torch.randn(E, H, I, generator=torch.Generator().manual_seed(8)) / I ** 0.5).to(dtype)
    weights = torch.softmax(torch.randn(T, k, generator=torch.Generator().manual_seed(9)), -1)
    routing = moe_ops._Routing(index, E, "test")
    experts = moe_ops._Experts(gate_up, down, None, None, moe_ops.SILU_GATE)
    (out, (gu, y)), (out_loop, (gu_loop, y_loop)) = (
        moe_ops.experts_forward(TritonGemmBackend(), x, weights, experts, routing, keep, dtype, grouped=grouped)
        for grouped in (True, False))
    assert torch.equal(out, out_loop)
    assert (gu is None) == (y is None) == (not keep)
    if keep:
        assert y.dtype == torch.float32 and torch.equal(y, y_loop) and torch.equal(gu, gu_loop)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpt_oss_experts_grouped_equal_the_per_expert_loop_forward_and_backward(dtype):
    """Transposed weights, biases and the interleaved clamped SwiGLU: the grouped launches
    give the per-expert loop's bits, the output, dX and every weight and bias gradient."""
    from rlkernels.gemm.backends import TritonGemmBackend
    H, I, E, k, T = 20, 6, 7, 3, 13  # noqa: E741
    g = torch.Generator().manual_seed(5)
    x, _, index = _case(T, E, k, H, 2 * I, dtype, seed=5, crowd=2)
    params = [(torch.randn(*shape, generator=g) * scale).to(dtype) for shape, scale in
              (((E, H, 2 * I), 3.5 / H ** 0.5), ((E, I, H), I ** -0.5), ((E, 2 * I), 1.0), ((E, H), 1.0))]
    act = moe_ops.GatedActivation(interleaved=True, limit=7.0, alpha=1.702)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    grad = torch.randn(T, H, generator=g).to(dtype).float()
    runs = []
    for grouped in (True, False):
        routing = moe_ops._Routing(index, E, "test")
        experts = moe_ops._Experts.of(*params, act, transposed=True)
        out, (gu_sorted, _) = moe_ops.experts_forward(TritonGemmBackend(), x, weights, experts, routing, True, dtype,
                                                      grouped=grouped)
        grads = [moe_ops._expert_grads("test", t, True, grouped, "w") for t in params]
        views = [(grads[0][0].mT, None), (grads[1][0].mT, None), grads[2], grads[3]]
        dx = moe_ops.experts_backward(TritonGemmBackend(), grad, x, weights, experts, gu_sorted, routing,
                                      (True,) * 5, views, grouped)
        runs.append([out, dx, *(pair[0] for pair in grads)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert all(t.abs().max() > 0 for t in runs[0][2:])


# ---------------------------------------------------------------- weight gradient (interpreter)


def _per_expert_dw(a, b, slot_end, *, b_rows=None, out=None, out_dtype=None):
    """What the per-expert loop computes (``ops.moe._weight_grads``, not grouped):
    gemm(a[s0:s1]^T, b[s0:s1]) rounded into a zeroed [E, M, N], or chained into ``out``."""
    from rlkernels.gemm.backends import TritonGemmBackend
    ends = slot_end.tolist()
    spans = [(e, s0, s1) for e, (s0, s1) in enumerate(zip([0] + ends[:-1], ends)) if s1 > s0]
    routing = types.SimpleNamespace(slot_end=slot_end, spans=lambda: spans)
    grad = None
    if out is None:
        grad = torch.zeros(len(ends), a.shape[1], b.shape[1], dtype=out_dtype or a.dtype, device=a.device)
    moe_ops._weight_grads(TritonGemmBackend(), a, b, b_rows, routing, grad, out, grouped=False)
    return out if grad is None else grad


def _wgrad_case(counts, M, N, dtype, seed=0, tokens=None, device="cpu"):
    """a [slots, M], b and b_rows (``tokens``: b is [tokens, N], each slot reading a random
    token's row; else b is [slots, N], no b_rows), slot_end from the per-expert counts."""
    g = torch.Generator().manual_seed(seed)
    slots = sum(counts)
    a = torch.randn(slots, M, generator=g).to(device, dtype)
    b = torch.randn(tokens or slots, N, generator=g).to(device, dtype)
    b_rows = torch.randint(0, tokens, (slots,), generator=g).to(device) if tokens else None
    return a, b, b_rows, torch.tensor(counts).cumsum(0).to(device)


WGRAD_COUNTS = [0, 1, 17, 33, 0, 16]  # empty experts first and inside; tails of 1 and 17 tokens


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [None, GemmConfig(4, 16, 16, group_m=1, num_warps=4, num_stages=1)],
                         ids=["interp_tile", "4x16x16"])
@pytest.mark.parametrize("tokens", [None, 23], ids=["rows", "gathered"])
def test_grouped_wgrad_is_the_per_expert_dw(dtype, config, tokens):
    M, N = 13, 37  # primes: partial tiles in both dims
    a, b, b_rows, slot_end = _wgrad_case(WGRAD_COUNTS, M, N, dtype, tokens=tokens)
    want = _per_expert_dw(a, b, slot_end, b_rows=b_rows)
    got = grouped_wgrad(a, b, slot_end, b_rows=b_rows, config=config)
    assert got.shape == (6, M, N) and got.dtype == dtype and torch.equal(got, want)
    assert not got[0].any() and not got[4].any()
    # Into a given buffer (int32 ends): every expert written, the empty ones with zeros.
    filled = torch.full((6, M, N), float("nan"), dtype=dtype)
    grouped_wgrad(a, b, slot_end.to(torch.int32), b_rows=b_rows, out=filled, config=config)
    assert torch.equal(filled, want)
    # fp32 out: the chain before the rounding.
    want32 = _per_expert_dw(a, b, slot_end, b_rows=b_rows, out_dtype=torch.float32)
    got32 = grouped_wgrad(a, b, slot_end, b_rows=b_rows, out_dtype=torch.float32, config=config)
    assert torch.equal(got32, want32) and (dtype == torch.float32 or not torch.equal(got32, got.float()))
    # Chained into main_grad (through a strided view): the per-expert accumulate calls' bits;
    # experts with no slot keep their values.
    start = torch.randn(M, 6, N, generator=torch.Generator().manual_seed(1)).transpose(0, 1)
    main = start.clone()
    grouped_wgrad(a, b, slot_end, b_rows=b_rows, out=main, accumulate=True, config=config)
    assert torch.equal(main, _per_expert_dw(a, b, slot_end, b_rows=b_rows, out=start.clone()))
    assert torch.equal(main[0], start[0]) and torch.equal(main[4], start[4])
    assert not torch.equal(main[1], start[1])


@interpreter_only
def test_grouped_wgrad_of_no_slots_and_bad_calls():
    a, b, _, slot_end = _wgrad_case([0, 0, 0], 5, 7, torch.float32)
    assert torch.equal(grouped_wgrad(a, b, slot_end, out=torch.ones(3, 5, 7)), torch.zeros(3, 5, 7))
    start = torch.randn(3, 5, 7)
    assert torch.equal(grouped_wgrad(a, b, slot_end, out=start.clone(), accumulate=True), start)
    a, b, _, slot_end = _wgrad_case([2, 3], 5, 7, torch.float32)
    with pytest.raises(ValueError, match="float32"):
        grouped_wgrad(a, b, slot_end, out=torch.zeros(2, 5, 7, dtype=torch.float16), accumulate=True)
    with pytest.raises(ValueError, match="accumulate needs out"):
        grouped_wgrad(a, b, slot_end, accumulate=True)
    with pytest.raises(ValueError, match="out must be"):
        grouped_wgrad(a, b, slot_end, out=torch.zeros(2, 7, 5))
    with pytest.raises(ValueError, match="rows for 5 slots"):
        grouped_wgrad(a, b[:4], slot_end)


def _split_slots(slot_end, first):
    """Per expert e, its first ``first[e]`` sorted slots to micro-batch 1 and the rest to 2:
    (slot indices, slot_end) of each."""
    ends = slot_end.tolist()
    parts = ([], []), ([], [])
    for (s0, s1), n in zip(zip([0] + ends[:-1], ends), first):
        for (idx, part_ends), (lo, hi) in zip(parts, ((s0, s0 + n), (s0 + n, s1))):
            idx.extend(range(lo, hi))
            part_ends.append(len(idx))
    return [(torch.tensor(idx, dtype=torch.long, device=slot_end.device),
             torch.tensor(part_ends, device=slot_end.device)) for idx, part_ends in parts]


def _micro_batches_and_one(a, b, slot_end, first, start, b_rows=None):
    """main_grad after the two micro-batches of :func:`_split_slots`, and after the one batch."""
    split = start.clone()
    for idx, ends in _split_slots(slot_end, first):
        rows = None if b_rows is None else b_rows[idx]
        grouped_wgrad(a[idx], b if b_rows is not None else b[idx], ends, b_rows=rows, out=split, accumulate=True)
    one = grouped_wgrad(a, b, slot_end, b_rows=b_rows, out=start.clone(), accumulate=True)
    return split, one


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_wgrad_micro_batches_chain_like_one_batch(dtype):
    """main_grad continues each expert's chain: micro-batches that give every expert a
    multiple of TOKEN_BLOCK tokens (all but the last) accumulate exactly like one batch,
    the promise ``rlkernels.linear``'s dW makes for its token counts."""
    tb = rlkernels.TOKEN_BLOCK
    counts = [0, 1, 2 * tb + 1, 3 * tb, 0, tb + 5]
    first = [0, 0, tb, 2 * tb, 0, tb]
    a, b, b_rows, slot_end = _wgrad_case(counts, 7, 11, dtype, seed=2, tokens=29)
    start = torch.randn(6, 7, 11, generator=torch.Generator().manual_seed(3))
    split, one = _micro_batches_and_one(a, b, slot_end, first, start, b_rows)
    assert torch.equal(split, one)


# ---------------------------------------------------------------- backward (interpreter)


def _backward_case(T, E, k, H, I, dtype, seed=0, crowd=None):  # noqa: E741
    """What :func:`moe_ops.experts_backward` reads: x, weights, gate_up, down, routing, the
    kept gate/up outputs (sorted slot order) and g = dOut fp32."""
    from rlkernels.gemm.backends import TritonGemmBackend
    x, gate_up, index = _case(T, E, k, H, 2 * I, dtype, seed=seed, crowd=crowd)
    gen = torch.Generator().manual_seed(seed + 100)
    down = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(dtype)
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1)
    g = torch.randn(T, H, generator=gen).to(dtype).float()
    routing = moe_ops._Routing(index, E, "test")
    experts = moe_ops._Experts(gate_up, down, None, None, moe_ops.SILU_GATE)
    _, (gu_sorted, _) = moe_ops.experts_forward(TritonGemmBackend(), x, weights, experts, routing, True, dtype,
                                                grouped=True)
    return x, weights, gate_up, down, index, routing, gu_sorted, g


def _experts_backward(case, needs, grouped, routing=None):
    """(dX, d gate_up, d down) of :func:`moe_ops.experts_backward`; ``needs`` for those three.
    A weight with a ``main_grad`` has it continued and gives None."""
    from rlkernels.gemm.backends import TritonGemmBackend
    x, weights, gate_up, down, _, case_routing, gu_sorted, g = case
    experts = moe_ops._Experts(gate_up, down, None, None, moe_ops.SILU_GATE)
    grads = [moe_ops._expert_grads("test", t, need, grouped, name)
             for t, need, name in ((gate_up, needs[1], "gate_up_proj"), (down, needs[2], "down_proj"))]
    dx = moe_ops.experts_backward(TritonGemmBackend(), g, x, weights, experts, gu_sorted, routing or case_routing,
                                  (*needs, False, False), [*grads, (None, None), (None, None)], grouped)
    return dx, grads[0][0], grads[1][0]


def _both_backwards(case, needs):
    return [_experts_backward(case, needs, grouped) for grouped in (True, False)]


BACKWARD_CASES = [
    (7, 6, 3, 20, 6, None),    # T prime, half the experts empty, H and I not multiples of the tile
    (5, 4, 1, 19, 11, 2),      # top-1, one expert receives every token
    (11, 9, 3, 18, 5, 4),      # one expert crowded (all 11 tokens), the others sparse
    (1, 5, 2, 17, 7, None),    # one token
]


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, E, k, H, I, crowd", BACKWARD_CASES)
def test_grouped_backward_equals_the_per_expert_backward(dtype, T, E, k, H, I, crowd):  # noqa: E741
    case = _backward_case(T, E, k, H, I, dtype, crowd=crowd)
    (dx, dgu, ddown), (dx_loop, dgu_loop, ddown_loop) = _both_backwards(case, (True, True, True))
    assert dx.dtype == dtype and dx.shape == (T, H) and torch.equal(dx, dx_loop)
    assert torch.equal(dgu, dgu_loop) and torch.equal(ddown, ddown_loop)
    # dX alone (no weight gradient: the grouped path reads no count), and each weight alone.
    only = ((True, False, False), (False, True, False), (False, False, True)) if k == 1 else ((True, False, False),)
    for needs in only:
        got, want = _both_backwards(case, needs)
        for a, b, ref in zip(got, want, (dx, dgu, ddown)):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b) and torch.equal(a, ref)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, E, k, H, I, crowd", BACKWARD_CASES)
def test_grouped_backward_chains_main_grad_like_the_per_expert_backward(dtype, T, E, k, H, I, crowd):  # noqa: E741
    """With ``main_grad`` on both weights the grouped weight gradients continue it with the
    per-expert loop's bits (experts nobody chose keep theirs), and the grouped backward
    reads no count on the host."""
    from rlkernels.gemm.backends import TritonGemmBackend
    case = _backward_case(T, E, k, H, I, dtype, crowd=crowd)
    x, weights, gate_up, down, index, _, gu_sorted, g = case
    gen = torch.Generator().manual_seed(21)
    starts = [torch.randn(w.shape, generator=gen) for w in (gate_up, down)]
    runs = []
    for grouped in (True, False):
        routing = moe_ops._Routing(index, E, "test")
        gate_up.main_grad, down.main_grad = (s.clone() for s in starts)
        got = _experts_backward(case, (True, True, True), grouped, routing)
        assert got[1] is None and got[2] is None
        if grouped:
            assert routing._counts is None  # no count read on the host
        runs.append((got[0], gate_up.main_grad, down.main_grad))
    (dx, main_gu, main_down), (dx_loop, main_gu_loop, main_down_loop) = runs
    assert torch.equal(dx, dx_loop) and torch.equal(main_gu, main_gu_loop) and torch.equal(main_down, main_down_loop)
    counts = torch.bincount(index.reshape(-1), minlength=E)
    for e in range(E):
        unchanged = torch.equal(main_gu[e], starts[0][e]) and torch.equal(main_down[e], starts[1][e])
        assert unchanged == bool(counts[e] == 0), e


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_grouped_gemms_are_matmul_of_each_row_alone(dtype):
    """dh = dY @ down_e and dX = dgu @ gate_up_e through the transposed weight views: each
    sorted slot's row is ``rlkernels.matmul`` of its row alone, fp32 out (the per-expert
    backward's calls), on the interpreter tile and on a multi-row tile."""
    E, I, H = 5, 9, 21  # noqa: E741
    x, gate_up, index = _case(8, E, 3, H, 2 * I, dtype, seed=11, crowd=1)
    down = (torch.randn(E, H, I, generator=torch.Generator().manual_seed(12)) / I ** 0.5).to(dtype)
    routing = moe_ops._Routing(index, E, "test")
    experts = index.reshape(-1)[routing.order].tolist()
    dy = torch.randn(routing.slots, H, generator=torch.Generator().manual_seed(13)).to(dtype)
    dgu = torch.randn(routing.slots, 2 * I, generator=torch.Generator().manual_seed(14)).to(dtype)
    for config in (None, WIDE_ROWS):
        dh, _ = grouped_gemm(dy, down.mT, routing.slot_end, routing.slots, out_dtype=torch.float32, config=config)
        dx, _ = grouped_gemm(dgu, gate_up.mT, routing.slot_end, routing.slots, c_rows=routing.order,
                             out_dtype=torch.float32, config=config)
        for s, e in enumerate(experts):
            assert torch.equal(dh[s], rlkernels.matmul(dy[s:s + 1], down[e], out_dtype=torch.float32,
                                                       backend="triton")[0]), (s, e)
            slot = int(routing.order[s])
            assert torch.equal(dx[slot], rlkernels.matmul(dgu[s:s + 1], gate_up[e], out_dtype=torch.float32,
                                                          backend="triton")[0]), (s, e)


def _moe_grads(x, index, weights, gate_up, down, grad, only_x=False):
    leaves = [t.detach().clone().requires_grad_(not only_x or i == 0)
              for i, t in enumerate((x, weights, gate_up, down))]
    out = rlkernels.ops.moe.moe_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], backend="triton")
    out.backward(grad)
    return [t.grad for t in leaves]


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_backward_twice_and_a_tokens_dx_alone(dtype):
    x, weights, gate_up, down, index, _, _, g = _backward_case(7, 6, 3, 16, 6, dtype, seed=4, crowd=3)
    grad = g.to(dtype)
    first = _moe_grads(x, index, weights, gate_up, down, grad)
    second = _moe_grads(x, index, weights, gate_up, down, grad)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    only_x = _moe_grads(x, index, weights, gate_up, down, grad, only_x=True)
    assert torch.equal(only_x[0], first[0]) and only_x[2] is None
    for t in (0, 3, 6):
        alone = _moe_grads(x[t:t + 1], index[t:t + 1], weights[t:t + 1], gate_up, down, grad[t:t + 1], only_x=True)
        assert torch.equal(alone[0][0], first[0][t]), t


@interpreter_only
def test_moe_backward_of_no_tokens():
    x, weights, gate_up, down, index, _, _, g = _backward_case(3, 4, 2, 16, 8, torch.float32)
    dx, dw, dgu, ddown = _moe_grads(x[:0], index[:0], weights[:0], gate_up, down, g[:0])
    assert dx.shape == (0, 16) and dw.shape == (0, 2)
    assert not dgu.any() and not ddown.any()


# ---------------------------------------------------------------- GPU

QWEN3_30B_A3B = dict(H=2048, E=128, k=8, I=768)


def _gpu_layer(T, dtype, seed=0, unused=0):
    """``unused``: that many experts (the last ones) are never chosen."""
    H, E, k, I = QWEN3_30B_A3B["H"], QWEN3_30B_A3B["E"], QWEN3_30B_A3B["k"], QWEN3_30B_A3B["I"]  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to("cuda", dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to("cuda", dtype)
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to("cuda", dtype)
    # Skewed routing: a quarter of the experts take most tokens, some get none.
    logits = torch.randn(T, E, generator=g) + 3 * (torch.arange(E) < E // 4)
    logits[:, E - unused:] = float("-inf")
    index = rlkernels.ops.moe.top_k_lowest_id(logits, k).to("cuda")
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).to("cuda")
    return x, gate_up, down, index, weights


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 16, 4096])
def test_grouped_moe_layer_gpu(dtype, T):
    from rlkernels.gemm.backends import TritonGemmBackend
    x, gate_up, down, index, weights = _gpu_layer(T, dtype)
    k, I = index.shape[1], down.shape[2]  # noqa: E741
    routing = moe_ops._Routing(index, gate_up.shape[0], "test")
    tokens = routing.order // k
    gu, _ = grouped_gemm(x, gate_up, routing.slot_end, routing.slots, a_rows=tokens)
    # Each slot's row is rlkernels.linear of the row alone (a sample at T = 4096: every
    # expert's first and last slot and 200 more), and of the expert's rows as one batch.
    flat = index.reshape(-1)
    order = routing.order.tolist()
    ends = routing.slot_end.tolist()
    starts = [0] + ends[:-1]
    sample = range(len(order)) if T <= 16 else sorted(
        {s for a, b in zip(starts, ends) if b > a for s in (a, b - 1)} | set(range(0, len(order), len(order) // 200)))
    for s in sample:
        t, e = order[s] // k, int(flat[order[s]])
        assert torch.equal(gu[s], rlkernels.linear(x[t:t + 1], gate_up[e])[0]), (s, t, e)
    for e, (a, b) in enumerate(zip(starts, ends)):
        if b > a:
            assert torch.equal(gu[a:b], rlkernels.linear(x.index_select(0, tokens[a:b]), gate_up[e])), e
    # The fused epilogue: ATen's silu and mul on the stored gate/up outputs, bit for bit.
    h, gu_kept = grouped_gemm(x, gate_up, routing.slot_end, routing.slots, a_rows=tokens, silu_up=True,
                              keep_gate_up=True)
    assert torch.equal(gu_kept, gu)
    assert torch.equal(h, F.silu(gu[:, :I]) * gu[:, I:])
    # The layer: the grouped path equals the per-expert loop, alone and in the batch.
    experts = moe_ops._Experts(gate_up, down, None, None, moe_ops.SILU_GATE)
    for keep in (False, True):
        (out, (gu_g, y)), (out_loop, (gu_loop, y_loop)) = (
            moe_ops.experts_forward(TritonGemmBackend(), x, weights, experts, routing, keep, dtype, grouped=grouped)
            for grouped in (True, False))
        assert torch.equal(out, out_loop)
        assert gu_g is None if not keep else torch.equal(gu_g, gu_loop) and torch.equal(y, y_loop)
    batched = rlkernels.ops.moe.moe_experts(x, index, weights, gate_up, down)
    for t in sorted({0, T // 2, T - 1}):
        alone = rlkernels.ops.moe.moe_experts(x[t:t + 1], index[t:t + 1], weights[t:t + 1], gate_up, down)
        assert torch.equal(alone[0], batched[t]), t


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_grouped_forward_captures_into_a_cuda_graph_gpu():
    x, gate_up, down, index, weights = _gpu_layer(16, torch.bfloat16)
    with torch.no_grad():
        eager = rlkernels.ops.moe.moe_experts(x, index, weights, gate_up, down)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compile outside the capture
            rlkernels.ops.moe.moe_experts(x, index, weights, gate_up, down)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = rlkernels.ops.moe.moe_experts(x, index, weights, gate_up, down)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 16, 256, 4096])
def test_grouped_wgrad_gpu(dtype, T):
    """Both weight gradients of the 30B-A3B layer (skewed routing, 8 experts unused):
    ``grouped_wgrad`` equals the per-expert dW calls bit for bit, rounded to the dtype and
    chained into an fp32 main_grad; micro-batches giving each expert a multiple of
    TOKEN_BLOCK tokens chain like one batch."""
    x, gate_up, down, index, _ = _gpu_layer(T, dtype, unused=8)
    E, k, H, I = gate_up.shape[0], index.shape[1], x.shape[1], down.shape[2]  # noqa: E741
    routing = moe_ops._Routing(index, E, "test")
    assert 0 in routing.counts
    tokens = routing.order // k
    g = torch.Generator().manual_seed(2)
    dy = torch.randn(routing.slots, H, generator=g).to("cuda", dtype)
    h = torch.randn(routing.slots, I, generator=g).to("cuda", dtype)
    dgu = torch.randn(routing.slots, 2 * I, generator=g).to("cuda", dtype)
    for a, b, b_rows in ((dy, h, None), (dgu, x, tokens)):  # d down, d gate_up
        want = _per_expert_dw(a, b, routing.slot_end, b_rows=b_rows)
        assert torch.equal(grouped_wgrad(a, b, routing.slot_end, b_rows=b_rows), want)
        start = torch.randn(want.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
        main = grouped_wgrad(a, b, routing.slot_end, b_rows=b_rows, out=start.clone(), accumulate=True)
        assert torch.equal(main, _per_expert_dw(a, b, routing.slot_end, b_rows=b_rows, out=start.clone()))
        tb = rlkernels.TOKEN_BLOCK
        first = [n // (2 * tb) * tb for n in routing.counts]
        split, one = _micro_batches_and_one(a, b, routing.slot_end, first, start, b_rows)
        assert torch.equal(split, one) and torch.equal(one, main)
        del want, start, main, split, one


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 16, 256, 4096])
def test_grouped_moe_backward_gpu(dtype, T):
    """The grouped backward's dX and weight gradients (returned, and chained into main_grad)
    equal the per-expert backward's bit for bit; dh's rows are ``rlkernels.matmul`` of each
    row alone; a token's dX is the same alone and in the batch."""
    from rlkernels.gemm.backends import TritonGemmBackend
    x, gate_up, down, index, weights = _gpu_layer(T, dtype, unused=8)
    E, k = gate_up.shape[0], index.shape[1]
    routing = moe_ops._Routing(index, E, "test")
    experts = moe_ops._Experts(gate_up, down, None, None, moe_ops.SILU_GATE)
    _, (gu_sorted, _) = moe_ops.experts_forward(TritonGemmBackend(), x, weights, experts, routing, True, dtype,
                                                grouped=True)
    g = torch.randn(T, x.shape[1], generator=torch.Generator().manual_seed(1)).to("cuda", dtype).float()
    case = (x, weights, gate_up, down, index, routing, gu_sorted, g)
    runs = {}
    for needs in ((True, False, False), (True, True, True)):
        for grouped in (True, False):
            runs[needs, grouped] = _experts_backward(case, needs, grouped)
    full, full_loop = runs[(True, True, True), True], runs[(True, True, True), False]
    assert all(torch.equal(a, b) for a, b in zip(full, full_loop))
    assert torch.equal(runs[(True, False, False), True][0], full[0])
    assert torch.equal(runs[(True, False, False), False][0], full[0])
    # main_grad on both weights: the same chains, continued from its values.
    gen = torch.Generator(device="cuda").manual_seed(3)
    starts = [torch.randn(w.shape, device="cuda", generator=gen) for w in (gate_up, down)]
    mains = []
    for grouped in (True, False):
        gate_up.main_grad, down.main_grad = (s.clone() for s in starts)
        _experts_backward(case, (False, True, True), grouped)
        mains.append((gate_up.main_grad, down.main_grad))
    del gate_up.main_grad, down.main_grad
    assert torch.equal(mains[0][0], mains[1][0]) and torch.equal(mains[0][1], mains[1][1])
    del mains, starts
    # dh through the transposed down view: each sampled slot's row is matmul of the row alone.
    acc = torch.float32
    dy_sorted = (weights[:, :, None] * g[:, None, :]).view(T * k, -1).index_select(0, routing.order).to(dtype)
    dh, _ = grouped_gemm(dy_sorted, down.mT, routing.slot_end, routing.slots, out_dtype=acc)
    experts = index.reshape(-1)[routing.order].tolist()
    for s in sorted({0, len(experts) // 3, len(experts) // 2, len(experts) - 1}):
        e = experts[s]
        assert torch.equal(dh[s], rlkernels.matmul(dy_sorted[s:s + 1], down[e], out_dtype=acc)[0]), (s, e)
    # Through moe_experts: a token's dX alone equals its row of the batch's.
    grad = g.to(dtype)

    def dx_of(rows):
        xr = x[rows].detach().clone().requires_grad_()
        rlkernels.ops.moe.moe_experts(xr, index[rows], weights[rows], gate_up, down).backward(grad[rows])
        return xr.grad

    batched = dx_of(slice(0, T))
    assert torch.equal(batched, dx_of(slice(0, T)))
    for t in sorted({0, T // 2, T - 1}):
        assert torch.equal(dx_of(slice(t, t + 1))[0], batched[t]), t
