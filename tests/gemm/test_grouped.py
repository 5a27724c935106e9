"""The grouped GEMM over experts: every sorted slot's row has the bits of ``rlkernels.linear``
on its token row alone with its expert's weight; the fused silu * up has the unfused
path's bits; ``moe_experts`` on the grouped kernels equals the per-expert loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import rlkernels
from rlkernels.gemm.grouped import grouped_gemm, max_row_tiles
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
    routing = moe_ops._Routing(index, E, "test")
    y_loop, gu_loop = moe_ops.per_expert_forward(TritonGemmBackend(), x, gate_up, down, routing, keep)
    y, gu = moe_ops.grouped_experts_forward(x, gate_up, down, routing, keep)
    assert y.dtype == torch.float32 and torch.equal(y, y_loop)
    assert (gu is None) == (not keep) and (gu is None or torch.equal(gu, gu_loop))


# ---------------------------------------------------------------- GPU

QWEN3_30B_A3B = dict(H=2048, E=128, k=8, I=768)


def _gpu_layer(T, dtype, seed=0):
    H, E, k, I = QWEN3_30B_A3B["H"], QWEN3_30B_A3B["E"], QWEN3_30B_A3B["k"], QWEN3_30B_A3B["I"]  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to("cuda", dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to("cuda", dtype)
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to("cuda", dtype)
    # Skewed routing: a quarter of the experts take most tokens, some get none.
    logits = torch.randn(T, E, generator=g) + 3 * (torch.arange(E) < E // 4)
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
    for keep in (False, True):
        y_loop, gu_loop = moe_ops.per_expert_forward(TritonGemmBackend(), x, gate_up, down, routing, keep)
        y, gu_g = moe_ops.grouped_experts_forward(x, gate_up, down, routing, keep)
        assert torch.equal(y, y_loop)
        assert gu_g is None if not keep else torch.equal(gu_g, gu_loop)
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
