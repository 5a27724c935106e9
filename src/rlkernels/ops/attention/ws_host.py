"""Host side of the warp-specialized Hopper forward (``kernels.attention.forward_ws``, Gluon).

It computes ``attn_fwd_kernel``'s chain with the same instructions. wgmma makes it sm_90
only; its stages hold key blocks of WS_BLOCK_N. WS_CONSUMERS: the head dims it takes,
each with its consumer warpgroups per CTA. Measured against the Triton kernel (bf16,
causal, B * L = 16384): D = 128 with two, 1.1-1.2x at L >= 1024 (H100); D = 64 with
three, 311 -> 341 TFLOP/s at L = 4096 and 354 -> 389 at 16384, level at 1024, where two
consumers measured level or slower (H200).
"""
from __future__ import annotations

import torch

from ..._env import switch_on
from ...kernels._triton import GluonTensorDescriptor, cdiv, gl
from ...kernels.attention.forward_ws import WG_ROWS, attn_fwd_ws_kernel, consumer_registers, launch_registers
from ...runtime.device import capability, sm_count
from ...runtime.launcher import DEFAULT_NUM_STAGES, cached_launcher
from .launch import FWD_OPTIONS, AttnTuning
from .layout import TMA_DTYPES, tma_pays

WS_CONSUMERS = {64: 3, 128: 2}
WS_BLOCK_N = 64
WS_STAGES = 3
# ``RLKERNELS_ATTN_WS=0``: every forward stays on the Triton kernel (the same bits).
WS_ENV = "RLKERNELS_ATTN_WS"
# The persistent kernel's tile index (a round's first tile plus the program id) is an int32.
WS_MAX_TILES = 1 << 30
_WS_LAYOUTS: dict[tuple[torch.dtype, tuple[int, ...]], object] = {}

# The launch by consumer count: each count's launch has its own maxnreg. Decode steps are
# host-bound: later launches skip Triton's binder (runtime.launcher).
_launch_fwd_ws = ({c: cached_launcher(attn_fwd_ws_kernel, options={**FWD_OPTIONS, "maxnreg": launch_registers(c)})
                   for c in sorted(set(WS_CONSUMERS.values()))} if attn_fwd_ws_kernel is not None else {})


def ws_layout(dtype: torch.dtype, block: tuple[int, ...]) -> object:
    """The shared-memory layout of kernels.attention.forward_ws's tiles of shape ``block``."""
    layout = _WS_LAYOUTS.get((dtype, block))
    if layout is None:
        layout = _WS_LAYOUTS.setdefault((dtype, block), gl.NVMMASharedLayout.get_default_for(
            list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16))
    return layout


def _tma_strides_ok(t: torch.Tensor, strides: list[int]) -> bool:
    unit = 16 // t.element_size()  # TMA: 16-byte aligned base and strides
    return t.data_ptr() % 16 == 0 and all(s > 0 and s % unit == 0 for s in strides[:-1])


def ws_rows_desc(t: torch.Tensor) -> object | None:
    """q or out [T, H, D] (heads side by side in a row) as the 2-D TMA view [T, H * D]
    kernels.attention.forward_ws reads (and writes) 64-row tiles of; None where TMA can't."""
    (n, h, d), (st, sh, sd) = t.shape, t.stride()
    strides = [st, 1]
    if sd != 1 or (sh != d and h > 1) or n < 1 or not _tma_strides_ok(t, strides) or n >= 1 << 31:
        return None
    shape = [n, h * d]
    return GluonTensorDescriptor(t.as_strided(shape, strides), shape, strides, [WG_ROWS, d],
                                 ws_layout(t.dtype, (WG_ROWS, d)))


def ws_keys_desc(t: torch.Tensor) -> tuple[object, int, int, int] | None:
    """Keys or values [NB, S, H, D] (unit last stride) as a 3-D TMA view [planes, S, cols]
    for kernels.attention.forward_ws, as (desc, XB, XH, XC): key j of sequence b, head h is row
    k_start + j of plane b * XB + h * XH at column h * XC, so the row extent is a batch
    row's S slots (TMA zero-fills past them). Heads side by side in a token give (1, 0,
    D), head planes (Hugging Face's [B, H, S, D]) (H, 1, 0); one batch row of packed
    sequences (NB = 1) XB = 0. None where TMA can't describe t."""
    (nb, rows, h, d), (sb, sr, sh, sd) = t.shape, t.stride()
    if sd != 1 or rows < 1 or nb < 1:
        return None
    if sh == d or h == 1:
        shape, strides, xh, xc = [nb, rows, h * d], [sb, sr, 1], 0, d
        xb = 1
    elif sr == d and (nb == 1 or sb == h * sh):
        shape, strides, xh, xc = [nb * h, rows, d], [sh, d, 1], 1, 0
        xb = h
    else:
        return None
    if shape[0] == 1:  # a stride TMA accepts where there is one plane (size-1 dims may carry any)
        strides[0] = rows * strides[1]
    if not _tma_strides_ok(t, strides) or shape[0] >= 1 << 31:
        return None
    desc = GluonTensorDescriptor(t.as_strided(shape, strides), shape, strides, [1, WG_ROWS, d],
                                 ws_layout(t.dtype, (1, WG_ROWS, d)))
    return desc, xb if nb > 1 else 0, xh, xc


def ws_programs(tiles: int, device: torch.device, programs: int | None = None) -> int:
    """Programs of the persistent warp-specialized forward: ``programs``, or (None) one per
    SM (its shared memory holds one per SM); at most one per tile. Launch detail: which
    program computes a tile changes no bit."""
    return min(tiles, programs if programs is not None else sm_count(device))


def ws_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
           bounds: tuple, nb: int, max_q: int, max_k: int, dense: tuple[int, int] | None, causal: bool,
           qk_scale: float, tuning: AttnTuning) -> bool:
    """The forward through the warp-specialized kernel, where it applies: q/out [Tq, Hq, D]
    rows, k/v [NB, S, Hkv, D]; ``bounds`` (q_start, q_len, k_start, k_len) or ``dense``
    (Lq, Lk: every sequence's Lk keys from slot 0 of its batch row) as
    :func:`~.triton_host.triton_fwd`; ``tuning``: the chain, the TMA size threshold and
    the program count (its tile and warps are fixed). Returns False (nothing launched)
    where it does not apply; the Triton kernel then computes the same bits."""
    d, hq = q.shape[2], q.shape[1]
    consumers = WS_CONSUMERS.get(d)
    chain = tuning.chain
    if (not _launch_fwd_ws or consumers is None or chain.block_n != WS_BLOCK_N or not switch_on(WS_ENV)
            or q.dtype not in TMA_DTYPES or not q.is_cuda or capability(q.device) != (9, 0)
            or not tma_pays(nb, hq, max_q, max_k, d, causal, min_flops=tuning.tma_min_flops)):
        return False
    hkv = k.shape[2]
    qd, od = ws_rows_desc(q), ws_rows_desc(out)
    kx, vx = ws_keys_desc(k), ws_keys_desc(v)
    if qd is None or od is None or kx is None or vx is None:
        return False
    num_m = cdiv(max_q, consumers * WG_ROWS)
    tiles = num_m * nb * hq
    if tiles > WS_MAX_TILES:
        return False
    (kd, *kxs), (vd, *vxs) = kx, vx
    lq, lk = dense if dense is not None else (0, 0)
    _launch_fwd_ws[consumers](
        (ws_programs(tiles, q.device, tuning.ws_programs),),
        (qd, kd, vd, od, out, vd.base, lse, *bounds, out.stride(0), vd.strides[0], vd.strides[1], lse.stride(0), hq,
         hq // hkv, lq, lk, k.shape[1], qk_scale, *kxs, *vxs, num_m, tiles),
        dict(CAUSAL=causal, BLOCK_N=chain.block_n, BLOCK_D=d, S_SPLIT=chain.split, STAGES=WS_STAGES, REVERSE_M=causal,
             DENSE=dense is not None, CONSUMERS=consumers, CONSUMER_REGS=consumer_registers(consumers)),
        num_warps=4, num_stages=DEFAULT_NUM_STAGES)
    return True
