"""The warp-specialized Hopper forward: its TMA views and register split, and on an sm_90
GPU its output and LSE == the Triton kernel's, bit for bit."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rlkernels.kernels._triton import GluonTensorDescriptor
from rlkernels.kernels.attention import forward_ws as W
from rlkernels.ops import attention as A
from rlkernels.ops.attention import layout, triton_host, ws_host
from rlkernels.ops.attention.launch import DEFAULT_TUNING
from rlkernels.runtime.device import capability

from ._cases import bits_equal, gpu_qkv


def test_ws_descriptor_layouts():
    """The warp-specialized kernel's TMA views: q/out rows [T, H * D]; keys with heads side
    by side (1, 0, D) or in Hugging Face's head planes read in place (H, 1, 0), a batch
    row's slots per plane, one packed run of rows (XB = 0); None where TMA can't."""
    if GluonTensorDescriptor is None:
        pytest.skip("Triton without Gluon")
    rows = torch.zeros(80, 3, 16, dtype=torch.float16)
    desc = ws_host.ws_rows_desc(rows)
    assert desc.shape == [80, 48] and desc.strides == [48, 1] and desc.block_shape == [64, 16]
    fused = torch.zeros(80, 5, 16, dtype=torch.bfloat16)[:, 1:4]  # a slice of a fused projection
    desc = ws_host.ws_rows_desc(fused)
    assert desc.shape == [80, 48] and desc.strides == [80, 1] and desc.base.data_ptr() == fused.data_ptr()
    assert ws_host.ws_rows_desc(torch.zeros(3, 80, 16, dtype=torch.float16).transpose(0, 1)) is None  # head planes
    t = torch.zeros(2, 40, 3, 16, dtype=torch.float16)
    desc, xb, xh, xc = ws_host.ws_keys_desc(t)
    assert (xb, xh, xc) == (1, 0, 16) and desc.shape == [2, 40, 48] and desc.strides == [1920, 48, 1]
    hf = torch.zeros(2, 3, 40, 16, dtype=torch.bfloat16).transpose(1, 2)
    desc, xb, xh, xc = ws_host.ws_keys_desc(hf)
    assert (xb, xh, xc) == (3, 1, 0) and desc.shape == [6, 40, 16] and desc.strides == [640, 16, 1]
    desc, xb, xh, xc = ws_host.ws_keys_desc(t[:1])  # packed sequences in one batch row
    assert (xb, xh, xc) == (0, 0, 16) and desc.shape == [1, 40, 48]
    misaligned = torch.zeros(2 * 40 * 3 * 16 + 1, dtype=torch.float16)[1:].view(2, 40, 3, 16)
    assert ws_host.ws_keys_desc(misaligned) is None and ws_host.ws_rows_desc(misaligned[0]) is None
    odd_rows = torch.zeros(2, 40, 3, 20, dtype=torch.float16)[..., :16]  # token stride 60: not 16-byte aligned
    assert ws_host.ws_keys_desc(odd_rows) is None
    assert ws_host.ws_keys_desc(torch.zeros(1, 40, 3, 16, dtype=torch.float16).expand(2, 40, 3, 16)) is None  # stride 0
    out = torch.zeros(80, 3, 16, dtype=torch.float16)
    assert not ws_host.ws_fwd(rows, t, t, out, torch.zeros(3, 80), (None,) * 4, 2, 40, 40, (40, 40), True, 1.0,
                        DEFAULT_TUNING)  # CPU: not launched


def test_ws_register_split_fits_the_register_file():
    """Each consumer count the warp-specialized forward launches with fits the SM's register
    file at launch ((consumers + 1) warpgroups at launch_registers) and after setmaxnreg
    (the producer's warpgroup at PRODUCER_REGS, each consumer at consumer_registers), in
    setmaxnreg's steps of 8, and setmaxnreg only raises the consumers' count."""
    for consumers in sorted(set(ws_host.WS_CONSUMERS.values())):
        launch, consumer = W.launch_registers(consumers), W.consumer_registers(consumers)
        assert launch % 8 == 0 and consumer % 8 == 0, consumers
        assert (consumers + 1) * 128 * launch <= W.REGISTER_FILE, consumers
        assert consumers * 128 * consumer + 128 * W.PRODUCER_REGS <= W.REGISTER_FILE, consumers
        assert W.PRODUCER_REGS <= launch <= consumer, consumers


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_warp_specialized_forward_gives_the_triton_kernels_bits(d, monkeypatch):
    """The warp-specialized Hopper forward == the Triton full kernel, output and LSE bit for
    bit, at both head dims it takes (two consumer warpgroups at 128, three at 64): odd
    lengths (1, primes, past a split: partial first-row tiles), Lq < Lk and Lq > Lk, causal
    and not, fp16, keys in Hugging Face's head planes and queries strided inside a fused
    QKV tensor; sequences by their bounds, packed and in a NaN-filled cache (left and right
    padding), also with the persistent kernel on 5 programs."""
    if capability(torch.device("cuda")) != (9, 0) or W.attn_fwd_ws_kernel is None:
        pytest.skip("the warp-specialized forward is for sm_90 with Gluon")
    # Every call takes it, however small (tma_min_flops 0); the reference is the Triton kernel's.
    with_ws = A.AttnTuning(tma_min_flops=0)

    def triton_only(max_q: int) -> A.AttnTuning:
        return A.AttnTuning(fwd=dataclasses.replace(A.default_fwd_launch(d, max_q), ws=False), tma_min_flops=0)

    launched = []

    def recording(launch):
        def launch_and_record(*args, **kwargs):
            launched.append(args[0])
            return launch(*args, **kwargs)
        return launch_and_record

    monkeypatch.setattr(ws_host, "_launch_fwd_ws", {c: recording(f) for c, f in ws_host._launch_fwd_ws.items()})
    g = torch.Generator(device="cuda").manual_seed(11)
    hq, hkv = 16, 8
    cases = [(2, 1031, 1031, True, torch.bfloat16, "plain"), (3, 1, 1, True, torch.bfloat16, "plain"),
             (1, 4099, 4099, True, torch.bfloat16, "plain"), (2, 131, 2053, True, torch.float16, "plain"),
             (1, 2053, 131, False, torch.bfloat16, "plain"), (2, 509, 509, False, torch.float16, "plain"),
             (2, 1031, 1031, True, torch.bfloat16, "hf"), (2, 1031, 1031, True, torch.bfloat16, "fused")]
    for b, lq, lk, causal, dtype, form in cases:
        if form == "fused":  # q, k, v columns of one [B, L, (Hq + 2 Hkv) * D] projection
            qkv_t = torch.randn(b, lq, (hq + 2 * hkv) * d, device="cuda", generator=g).to(dtype)
            q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv_t.split([hq * d, hkv * d, hkv * d], -1))
        else:
            q = torch.randn(b, lq, hq, d, device="cuda", generator=g).to(dtype)
            k, v = (torch.randn(b, lk, hkv, d, device="cuda", generator=g).to(dtype) for _ in range(2))
            if form == "hf":  # [B, Hkv, S, D] read in place
                k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
        n = len(launched)
        ws = A.flash_attn_func(q, k, v, causal=causal, _tuning=with_ws)
        assert len(launched) == n + 1, f"the warp-specialized kernel must run: {(b, lq, lk, form)}"
        ref = A.flash_attn_func(q, k, v, causal=causal, _tuning=triton_only(lq))
        assert len(launched) == n + 1
        assert bits_equal(ws, ref), (b, lq, lk, causal, dtype, form)
        lse_ws = triton_host.triton_fwd(layout.packed(q), k, v, None, None, None, None, lq, lk, causal, d ** -0.5,
                              with_ws, False, dense=(lq, lk))[1]
        lse_ref = triton_host.triton_fwd(layout.packed(q), k, v, None, None, None, None, lq, lk, causal, d ** -0.5,
                               triton_only(lq), False, dense=(lq, lk))[1]
        assert bits_equal(lse_ws, lse_ref), ("lse", b, lq, lk, causal, dtype, form)
    # sequences by their bounds: packed (the next sequence's keys follow), and in a NaN-filled
    # [B, Hkv, S, D] cache read in place, left- and right-padded (the last value block of a
    # right-padded sequence runs into free slots: it must read zeros, not NaN)
    lens, slots = [1, 1031, 4099, 509, 2053], 4200
    seqs = [[torch.randn(n, h, d, device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv)]
            for n in lens]
    dev = dict(dtype=torch.int32, device="cuda")
    q_rows = torch.cat([sq[0] for sq in seqs])
    q_start = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()[:-1], **dev)
    kl = torch.tensor(lens, **dev)
    packed_kv = [torch.cat([sq[i] for sq in seqs]) for i in (1, 2)]
    starts = [(slots - n) if b % 2 == 0 else 0 for b, n in enumerate(lens)]
    bufs = []
    for i in (1, 2):
        buf = torch.full((len(lens), hkv, slots, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        for b, (sq, s0) in enumerate(zip(seqs, starts)):
            buf[b, :, s0:s0 + lens[b]] = sq[i].transpose(0, 1)
        bufs.append(buf.transpose(1, 2))
    cases = [(keys, k_start, programs) for keys, k_start in ((packed_kv, q_start), (bufs, torch.tensor(starts, **dev)))
             for programs in (None, 5)]
    for keys, k_start, programs in cases:
        # programs=5: each program takes many tiles of unequal lengths (the empty tiles of the
        # short sequences among them) in snake rounds, the last round short; stage and
        # barrier phases run on from tile to tile.
        n = len(launched)
        ws = A.attention_by_bounds("test", q_rows, *keys, q_start, kl, k_start, kl, max(lens), keys[0].shape[-3],
                                   _tuning=dataclasses.replace(with_ws, ws_programs=programs))
        assert len(launched) == n + 1, "the warp-specialized kernel must run"
        ref = A.attention_by_bounds("test", q_rows, *keys, q_start, kl, k_start, kl, max(lens), keys[0].shape[-3],
                                    _tuning=triton_only(max(lens)))
        assert len(launched) == n + 1
        assert not ws.isnan().any() and bits_equal(ws, ref), programs
    n = len(launched)
    q, k, v = gpu_qkv(2, 1031, hq, hkv, 80, torch.bfloat16)
    A.flash_attn_func(q, k, v, _tuning=with_ws)
    assert len(launched) == n, "head_dim 80 stays on the Triton kernel"
    monkeypatch.setenv("RLKERNELS_ATTN_WS", "0")
    q, k, v = gpu_qkv(2, 1031, hq, hkv, d, torch.bfloat16)
    A.flash_attn_func(q, k, v, _tuning=with_ws)
    assert len(launched) == n, "RLKERNELS_ATTN_WS=0 keeps the Triton kernel"

