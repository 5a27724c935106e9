"""The Triton launches: K/V, q and dO blocks read through TMA descriptors give the pointer
loads' bits (interpreted, and on the GPU)."""
from __future__ import annotations

import pytest
import torch

from rlkernels.ops import attention as A
from rlkernels.ops.attention.key_blocks import DEFAULT_CHAIN

from ...conftest import interpreter_only, randn
from ._cases import SMALL_CHAIN, check_tma_equals_pointers, sizes


@interpreter_only
def test_tma_reads_give_the_pointer_loads_bits(gen, monkeypatch):
    """Outputs and dQ/dK/dV with K/V (forward, dQ) and q/dO (dK/dV) blocks read through TMA
    descriptors == with pointer loads, bit for bit: keys in place in a NaN-padded
    [B, Hkv, S, D] buffer and packed; lengths 1, a prime, several splits."""
    hq, hkv, d = sizes("triton")
    lens, starts, slots = [37, 1, 70], [5, 0, 2], 80
    seqs = [[randn(n, h, d, dtype=torch.float16, generator=gen) for h in (hq, hkv, hkv, hq)] for n in lens]
    check_tma_equals_pointers(A.Chain(*SMALL_CHAIN), lens, starts, slots, seqs, "cpu", "triton", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_tma_reads_give_the_pointer_loads_bits(d, monkeypatch):
    """On the GPU: TMA-read K/V, q and dO blocks give the pointer loads' bits (outputs and
    grads; keys in a left-padded NaN-filled buffer read in place, and packed)."""
    hq, hkv = 16, 8
    lens, slots = [1031, 1, 2048, 509], 2100
    g = torch.Generator(device="cuda").manual_seed(7)
    seqs = [[torch.randn(n, h, d, device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv, hq)]
            for n in lens]
    check_tma_equals_pointers(DEFAULT_CHAIN, lens, [slots - n for n in lens], slots, seqs, "cuda", None,
                               monkeypatch)

