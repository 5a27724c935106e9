"""The K-tree kernel gives the bits of the unfused tree: one GEMM per K segment (fp32 out) on the
Triton GEMM backend, then pairwise additions left to right, then the bias, rounded once."""
from __future__ import annotations

import pytest
import torch

from rlkernels._env import triton_interpret
from rlkernels.gemm.ktree import ktree_fusable, ktree_gemm
from rlkernels.ops.matmul import gemm_backend_for
from rlkernels.parallel.tree import tree_combine

from ..conftest import randn


def unfused(x, w, seg, n_seg, bias, out_dtype):
    gemm_backend = gemm_backend_for(x.device, "triton")
    parts = [gemm_backend.gemm(x[:, s * seg:(s + 1) * seg], w[:, s * seg:(s + 1) * seg].t(), out_dtype=torch.float32)
             for s in range(n_seg)]
    y = tree_combine(parts)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _case(m, n, seg, n_seg, dtype, device, gen, bias=True, transposed_x=False):
    k = seg * n_seg
    x = randn(k, m, dtype=dtype, device=device, generator=gen).t() if transposed_x else \
        randn(m, k, dtype=dtype, device=device, generator=gen)
    w = randn(n, k, dtype=dtype, device=device, generator=gen, scale=k ** -0.5)
    b = randn(n, dtype=dtype, device=device, generator=gen) if bias else None
    assert ktree_fusable(x, w, seg) != transposed_x
    if transposed_x:
        return
    for out_dtype in (torch.float32, dtype):
        want = unfused(x, w, seg, n_seg, b, out_dtype)
        for pairs in (False, True):  # leaf pairs through the scratch slots or in registers
            got = ktree_gemm(x, w, seg, n_seg, b, out_dtype, pairs=pairs)
            assert torch.equal(got, want), (m, n, seg, n_seg, dtype, out_dtype, pairs)


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("float32", "float16"))
@pytest.mark.parametrize("m,n,seg,n_seg", [(1, 16, 16, 1), (7, 33, 16, 4), (37, 24, 32, 8), (5, 9, 48, 2)])
def test_ktree_matches_unfused_tree_interpreter(dtype, m, n, seg, n_seg, gen):
    _case(m, n, seg, n_seg, dtype, "cpu", gen)


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
def test_ktree_refuses_what_tma_cannot_read_and_handles_empty(gen):
    _case(6, 16, 16, 4, torch.float32, "cpu", gen, bias=False, transposed_x=True)  # A not K-major
    x, w = torch.zeros(4, 64), torch.zeros(3, 64)
    assert not ktree_fusable(x, w, 8)  # a segment shorter than the tile's K step
    assert ktree_gemm(torch.zeros(0, 64), torch.zeros(8, 64), 16, 4).shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("m", [1, 17, 1000, 4096])
def test_ktree_matches_unfused_tree_gpu(dtype, m, gen):
    # Llama-3-8B o_proj / down_proj shapes at TP 1 and 2, and an odd one.
    for n, seg, n_seg in ((4096, 512, 8), (4096, 1792, 4), (1000, 128, 8), (4096, 4096, 1)):
        _case(m, n, seg, n_seg, dtype, "cuda", gen)
