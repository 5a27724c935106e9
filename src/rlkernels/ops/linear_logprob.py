"""``linear_logprob``: per-token log-prob (and entropy) of an lm head, without [N, V] logits.

    logp, entropy = linear_logprob(hidden, weight, target, bias, temperature=T,
                                   return_entropy=True)

computes, for every token row ``h`` and its target id ``t``,

    z       = (h @ W^T + b) / T                 (V logits, never stored as a whole)
    logp    = z_t - logsumexp(z)
    entropy = logsumexp(z) - sum_j softmax(z)_j * z_j

Both backends stream the vocabulary by the LSE chain (``ops.lse_chain``: splits of
2048 columns, tiles of 256 inside, fixed-point tile masses, splits merged in
ascending order) and keep per-row running statistics (max ``m``, ``s = sum exp(z - m)``
and ``u = sum exp(z - m) * (z - m)``), so the extra memory is O(N) plus one tile,
never O(N * V). ``s`` follows the chain exactly, so ``log_softmax`` of the logits
(``rlkernels.nn.LMHead``'s output) gives logp's bits at the target.

Invariance: every tile and split boundary is a function of V alone (never of N or of
a row's position), the logits are the canonical ascending D-chain (``gemm.triton``
conventions), and every per-row reduction runs over that row's own values in an
order fixed by V (the tile sums of ``s`` and ``u`` are exact fixed-point sums).
So a row's logp/entropy -- and its dhidden row -- are bitwise the same whatever else
is in the batch. dW reduces over tokens in one ascending fp32
chain per vocabulary chunk (the GEMM backend, no atomics), so it is run-to-run
deterministic and rounded once.

Backward (shared by both backends): for V chunks of ``Cv`` columns, a fused kernel
recomputes the chunk's logits and writes ``g = dL/d(h W^T + b)`` ([N, Cv], hidden
dtype); then ``dH += g @ W[chunk]`` (fp32 [N, D] accumulator chained over V
ascending), ``dW[chunk] = g^T @ H`` (one fp32 chain over tokens, rounded once, or
accumulated into ``weight.main_grad``), ``dbias[chunk] = column sums of g``. For
16-bit inputs the dH accumulator may sit in dW's last rows, written last: those
columns then take their dW after dH is final, from the last chunk's g or a recomputed
one (:func:`dw_tail_rows`), and the main loop runs wider chunks (:func:`main_loop_chunk`),
the widest with g in dW's rows not yet written (:func:`main_loop_schedule`).
"""
from __future__ import annotations

import dataclasses
import math
import struct

import torch

from . import _validate as V_
from ..registry import OpImpl, implementation, register, select_backend
from .._env import triton_interpret
from ..gemm.chain import accumulator_dtype, chain_matmul
from ..gemm.tma import TensorDescriptor, tma_layout_ok
from ..runtime.device import sm_count
from .matmul import gemm_backend_for, main_grad_target

from .lse_chain import LSE_SPLIT, LSE_TILE, lse_step, merge_splits, tile_mass
from .linear_logprob_schedule import (backward_chunk, dw_tail_rows, last_chunk_start, main_loop_chunk,
                                      main_loop_schedule)
from ..kernels._triton import cdiv
from ..kernels.linear_logprob import (TEMP_DIVIDE, TEMP_NONE, TEMP_RECIPROCAL, fwd_partial_kernel,
                                      grad_logits_kernel, logprob_combine_kernel)
from ..runtime.launcher import DEFAULT_NUM_STAGES, cached_launcher

OP = "linear_logprob"

# ---------------------------------------------------------------------------------------
# Constants. Each is a function of nothing but the dtype (and V for the split count):
# a row's bits must never depend on N.
# ---------------------------------------------------------------------------------------

# torch backend: token rows per step (memory only; every op is elementwise per row).
TORCH_ROW_CHUNK = 128

# ---------------------------------------------------------------------------------------
# Validation (host side, before any launch).
# ---------------------------------------------------------------------------------------

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def validate_head(op: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  temperature: float) -> None:
    """The LM head's operands and temperature, as every fused head op takes them; raises naming ``op``."""
    V_.require_tensor(op, "hidden", hidden)
    V_.require_tensor(op, "weight", weight)
    if bias is not None:
        V_.require_tensor(op, "bias", bias)
    V_.require_float(op, "hidden", hidden)
    V_.require_float(op, "weight", weight)
    if bias is not None:
        V_.require_float(op, "bias", bias)
    V_.require_ndim(op, "hidden", hidden, 1)
    V_.require_ndim(op, "weight", weight, 2, 2)
    if bias is not None:
        V_.require_ndim(op, "bias", bias, 1, 1)
    V_.require_same_dtype(op, hidden=hidden, weight=weight, bias=bias)
    vocab, dim = weight.shape
    if hidden.shape[-1] != dim:
        raise ValueError(f"rlkernels.{op}: hidden {tuple(hidden.shape)} has D={hidden.shape[-1]} but weight "
                         f"{tuple(weight.shape)} (lm_head layout [V, D]) has D={dim}")
    if vocab == 0:
        raise ValueError(f"rlkernels.{op}: weight has an empty vocabulary (V=0)")
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ValueError(f"rlkernels.{op}: bias must have shape ({vocab},) to match weight's V, "
                         f"got {tuple(bias.shape)}")
    V_.require_temperature(op, temperature)


def validate(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
             temperature: float, ignore_index: int) -> None:
    """Raise ValueError/TypeError (naming the op) on any bad input; syncs once to check ids."""
    validate_head(OP, hidden, weight, bias, temperature)
    V_.require_tensor(OP, "target", target)
    if target.dtype not in _INT_DTYPES:
        raise ValueError(f"rlkernels.{OP}: target must be an integer tensor of token ids, got {target.dtype}")
    V_.require_same_device(OP, hidden=hidden, weight=weight, target=target, bias=bias)
    vocab = weight.shape[0]
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"rlkernels.{OP}: target shape {tuple(target.shape)} must equal hidden's leading "
                         f"shape {tuple(hidden.shape[:-1])}")
    if target.numel() and target.device.type != "meta":  # meta tensors hold no ids to check
        t = target.reshape(-1)
        bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
        if bool(bad.any()):  # the one host sync of the call
            pos = int(bad.nonzero()[0, 0])
            raise ValueError(f"rlkernels.{OP}: target id {int(t[pos])} at flat position {pos} is outside "
                             f"[0, {vocab}) and is not ignore_index={ignore_index}")


# ---------------------------------------------------------------------------------------
# torch backend: ascending chains and pairwise trees of elementwise ops only.
# ---------------------------------------------------------------------------------------

def temperature_scaling(temperature: float, device: torch.device) -> tuple[float, int]:
    """(kernel argument, ``TEMP`` constexpr) for z / T computed as torch computes
    ``logits / T`` for a Python float T on ``device`` -- what samplers and trainers write
    (Hugging Face's temperature warper, TRL, verl), so their log_softmax of the scores
    gives this op's bits: on CUDA ATen multiplies by fl32(1 / fl32(T)); elsewhere it
    divides, correctly rounded."""
    if temperature == 1.0:
        return 1.0, TEMP_NONE
    if device.type == "cuda":
        # In doubles, then rounded to fp32: the correctly rounded fp32 quotient (a double
        # holds more than 2 * 24 + 2 bits, so the double rounding is innocuous), with no
        # tensor made on the host per call (decode calls are host-bound).
        return _to_fp32(1.0 / _to_fp32(temperature)), TEMP_RECIPROCAL
    return float(temperature), TEMP_DIVIDE


def _to_fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def torch_logits(h_rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  v0: int, v1: int, temperature: float) -> torch.Tensor:
    """z = (h W[v0:v1]^T + b) / T for a block of rows, fp32 (fp64 for fp64), ascending D-chain;
    / T is torch's own division by a Python float on that device (see :func:`temperature_scaling`)."""
    z = chain_matmul(h_rows, weight[v0:v1].t())
    if bias is not None:
        z.add_(bias[v0:v1].to(z.dtype))
    if temperature != 1.0:
        z.div_(temperature)
    return z


class TorchLinearLogprobBackend:
    """The two fused steps of the op, as chained elementwise torch ops (any device)."""

    name = "torch"

    def tile_v(self, dtype: torch.dtype) -> int:
        """The vocabulary tile whose mass ``statistics`` can record: the LSE chain's tile."""
        return LSE_TILE

    def n_tiles(self, vocab: int, dtype: torch.dtype) -> int:
        return cdiv(vocab, LSE_SPLIT) * (LSE_SPLIT // LSE_TILE)

    def statistics(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor,
                   temperature: float, pieces: tuple[torch.Tensor, torch.Tensor] | None = None,
                   entropy: bool = True):
        """Each row's (m, s, u, zt) [N] over the whole vocabulary by the LSE chain (the
        statistics the forward finishes; u is 0 without ``entropy``); with ``pieces``
        ([N, n_tiles] each), every tile's running max after it and its own mass too, as the
        Triton kernel records them."""
        N = h2.shape[0]
        vocab = weight.shape[0]
        adt = accumulator_dtype(h2.dtype)
        dev = h2.device
        n_split = cdiv(vocab, LSE_SPLIT)
        per_split = LSE_SPLIT // LSE_TILE
        m = torch.empty(N, dtype=adt, device=dev)
        s, u, zt = torch.empty_like(m), torch.empty_like(m), torch.empty_like(m)
        for r0 in range(0, N, TORCH_ROW_CHUNK):
            rows = slice(r0, r0 + TORCH_ROW_CHUNK)
            h_rows, t = h2[rows], tgt[rows]
            R = h_rows.shape[0]
            parts = torch.empty(3, n_split, R, dtype=adt, device=dev)  # per-split m, s, u
            ztr = torch.zeros(R, dtype=adt, device=dev)
            for k in range(n_split):
                v0, v1 = k * LSE_SPLIT, min(vocab, (k + 1) * LSE_SPLIT)
                z_split = torch_logits(h_rows, weight, bias, v0, v1, temperature)
                mr = torch.full((R,), -math.inf, dtype=adt, device=dev)
                sr = torch.zeros(R, dtype=adt, device=dev)
                ur = torch.zeros(R, dtype=adt, device=dev)
                for i, c0 in enumerate(range(0, v1 - v0, LSE_TILE)):
                    z = z_split[:, c0:c0 + LSE_TILE]
                    m_new, m_ref, alpha, e, d, mass, s_new = lse_step(mr, sr, z)
                    # u = sum e^(z-m) (z-m), kept relative to the running max: rescaled by
                    # alpha * (u + (m_old - m_new) s); 0 before the first tile (s == 0).
                    if entropy:
                        ur = torch.where(sr > 0, alpha * (ur + (mr - m_ref) * sr), torch.zeros_like(ur)) \
                            + tile_mass(e * d)
                    mr, sr = m_new, s_new
                    if pieces is not None:
                        pieces[0][rows, k * per_split + i] = mr
                        pieces[1][rows, k * per_split + i] = mass
                inside = (t >= v0) & (t < v1)
                picked = z_split.gather(1, (t - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0]
                ztr = torch.where(inside, picked, ztr)
                parts[0, k], parts[1, k], parts[2, k] = mr, sr, ur
            m[rows], s[rows], u[rows] = merge_splits(parts[0], parts[1], parts[2])
            zt[rows] = ztr
        return m, s, u, zt

    @staticmethod
    def finish(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, zt: torch.Tensor,
               tgt: torch.Tensor, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logp, entropy, lse) from the statistics; rows whose tgt is -1 get logp = entropy = 0;
        without ``entropy`` it is NaN (not computed)."""
        log_s = torch.log(s)
        valid = tgt >= 0
        zero = torch.zeros_like(s)
        ent = torch.where(valid, log_s - u / s, zero) if entropy else torch.full_like(s, math.nan)
        return torch.where(valid, (zt - m) - log_s, zero), ent, m + log_s

    def forward(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor,
                temperature: float, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logp, entropy, lse) [N] in fp32 (fp64 for fp64 inputs); tgt is -1 where ignored;
        without ``entropy`` the entropy is NaN and its sums are skipped."""
        return self.finish(*self.statistics(h2, weight, bias, tgt, temperature, entropy=entropy), tgt, entropy)

    def grad_logits(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor,
                    lse: torch.Tensor, ent: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
                    temperature: float, v0: int, v1: int, out: torch.Tensor) -> None:
        """out[:, :] = dL/d(raw logits)[:, v0:v1] in out.dtype (see :func:`_grad_formula`)."""
        for r0 in range(0, h2.shape[0], TORCH_ROW_CHUNK):
            rows = slice(r0, r0 + TORCH_ROW_CHUNK)
            z = torch_logits(h2[rows], weight, bias, v0, v1, temperature)
            t = tgt[rows]
            lp = z - lse[rows].to(z.dtype)[:, None]
            p = torch.exp(lp)
            gl = g_logp[rows].to(z.dtype)[:, None]
            coef = gl if g_ent is None else gl + g_ent[rows].to(z.dtype)[:, None] * (lp + ent[rows].to(z.dtype)[:, None])
            g = -(p * coef)
            cols = torch.arange(v0, v1, device=z.device)
            g = torch.where(cols[None, :] == t[:, None], g + gl, g)
            if temperature != 1.0:
                g = g / temperature
            out[rows].copy_(g)


# ---------------------------------------------------------------------------------------
# Triton backend.
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Tile config of the fused logits kernels, fixed per dtype. The forward's statistics
    do not depend on it (the LSE chain's fixed-point tile sums); ``block_v`` must be the
    chain's tile."""

    block_m: int
    block_v: int  # the LSE chain's tile (the forward's statistics follow it)
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # Operand tiles by TMA (Hopper+, 16-byte aligned rows) instead of pointer loads: the
    # same D-chain, zero-filled edges (gemm.tma).
    tma: bool = False
    # Backward g kernel: NUM_SMS programs walk the tiles instead of one program per tile.
    persistent: bool = False
    # Backward g kernel, with TMA loads: g stored by TMA too where its layout allows.
    tma_store: bool = False
    # Forward at N <= small_n rows: the logits [N, V] fp32 by the GEMM backend (the same
    # canonical chain, decode-tuned tiles over all of V), then the statistics over them in
    # blocks of small_block_m rows. At small N the fused kernel has one token block and
    # V / 2048 programs; the GEMM spreads the weight read over the whole GPU. The bits are
    # the fused kernel's either way (tests/ops/test_linear_logprob.py, on the GPU too).
    small_n: int = 64
    small_block_m: int = 16

    def __post_init__(self) -> None:
        if self.block_v != LSE_TILE:
            raise ValueError(f"rlkernels.{OP}: block_v must be the LSE chain's tile {LSE_TILE} (the forward's "
                             f"statistics are taken tile by tile), got {self.block_v}")

    @property
    def split_v(self) -> int:
        """Forward: columns per program, the LSE chain's split."""
        return LSE_SPLIT

    def short(self) -> str:
        return (f"{self.block_m}x{self.block_v}x{self.block_k}/g{self.group_m}"
                f"/w{self.num_warps}/s{self.num_stages}{'/tma' if self.tma else ''}"
                f"{'/pers' if self.persistent else ''}{'/tmastore' if self.tma_store else ''}")


# Checked in, never tuned at run time. The 16-bit entry matches the large-M tile of the
# GEMM table (128x256x64, 8 warps, 3 stages): the fused kernels are GEMMs with an epilogue.
# Why TMA loads, the persistent g schedule and the TMA store of g (same bits, measured):
# docs/design/linear_logprob_schedule.md.
FUSED_16BIT = FusedConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3, tma=True, persistent=True,
                          tma_store=True)
FUSED_FP32 = FusedConfig(32, 256, 32, group_m=8, num_warps=8, num_stages=2)
# The interpreter's tl.dot is numpy's BLAS, whose rounding depends on a row's place in
# the tile (see gemm.table): one row per program keeps every row's numpy calls identical.
# BLOCK_K = 16 as the interpreter's GEMM config: the interpreter sums a whole BLOCK_K
# per step, so the logits are rlkernels.linear's bits (as on the GPU, where the tensor
# cores' 16-wide K step is the same in every tile).
FUSED_INTERPRETER = FusedConfig(1, 256, 16, group_m=1, num_warps=4, num_stages=1, small_n=4, small_block_m=1)


def fused_config(dtype: torch.dtype) -> FusedConfig:
    if triton_interpret():
        return FUSED_INTERPRETER
    return FUSED_FP32 if dtype == torch.float32 else FUSED_16BIT


COMBINE_BLOCK = 256

# The launches skip Triton's binder after their first call with a given key (runtime.launcher).
_launch_fwd_partial = cached_launcher(fwd_partial_kernel) if fwd_partial_kernel is not None else None
_launch_combine = cached_launcher(logprob_combine_kernel) if logprob_combine_kernel is not None else None
_launch_grad_logits = cached_launcher(grad_logits_kernel) if grad_logits_kernel is not None else None


class TritonLinearLogprobBackend:
    """The two fused steps of the op as Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self, config: FusedConfig | None = None) -> None:
        self.config = config

    def _cfg(self, dtype: torch.dtype) -> FusedConfig:
        return self.config or fused_config(dtype)

    @staticmethod
    def _operands(h2: torch.Tensor, weight: torch.Tensor, cfg: FusedConfig) -> tuple[object, object, bool]:
        """(h, W, tma): TMA descriptors where the config asks and the layouts allow, else the tensors."""
        if cfg.tma and (h2.is_cuda or triton_interpret()) and TensorDescriptor is not None \
                and tma_layout_ok(h2) and tma_layout_ok(weight):
            N, D = h2.shape
            return (TensorDescriptor(h2, [N, D], [h2.stride(0), 1], [cfg.block_m, cfg.block_k]),
                    TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1], [cfg.block_v, cfg.block_k]),
                    True)
        return h2, weight, False

    def tile_v(self, dtype: torch.dtype) -> int:
        """The vocabulary tile whose mass ``statistics`` can record: the config's tile."""
        return self._cfg(dtype).block_v

    def n_tiles(self, vocab: int, dtype: torch.dtype) -> int:
        cfg = self._cfg(dtype)
        return cdiv(vocab, cfg.split_v) * (cfg.split_v // cfg.block_v)

    def statistics(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   tgt: torch.Tensor | None, temperature: float,
                   pieces: tuple[torch.Tensor, torch.Tensor] | None = None, entropy: bool = True,
                   partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """Per-split partials (m, s, u [n_split, N]; u is 0 without ``entropy``) and zt [N]; with ``pieces``
        ([N, n_split * split_v / block_v] each), every tile's running max and own mass too.
        ``tgt`` None: no target (zt is not computed, and None is returned for it);
        ``partials``: (m, s, u) buffers to fill instead of new ones."""
        N, D = h2.shape
        vocab = weight.shape[0]
        dev = h2.device
        cfg = self._cfg(h2.dtype)
        n_split = cdiv(vocab, cfg.split_v)
        # Partials: O(N * ceil(V / split_v)) fp32, the only O(N) state of the forward.
        if partials is None:
            m = torch.empty(n_split, N, dtype=torch.float32, device=dev)
            s = torch.empty_like(m)
            u = torch.empty_like(m)
        else:
            m, s, u = partials
        zt = torch.zeros(N, dtype=torch.float32, device=dev) if tgt is not None else None
        if N == 0:
            return m, s, u, zt
        bias = bias.contiguous() if bias is not None else None  # the kernels index it with unit stride
        temp_arg, temp_mode = temperature_scaling(temperature, h2.device)
        tile_m, tile_s = pieces if pieces is not None else (m, m)
        if N <= cfg.small_n:
            logits = gemm_backend_for(h2.device, "triton").gemm(h2, weight, bias=bias, out_dtype=torch.float32,
                                                                b_transposed=True)
            h_arg, w_arg, tma, block_m, group_m = h2, weight, False, cfg.small_block_m, 1
            num_warps, num_stages = 4, 2
        else:
            logits = m  # unread
            h_arg, w_arg, tma = self._operands(h2, weight, cfg)
            block_m, group_m, num_warps, num_stages = cfg.block_m, cfg.group_m, cfg.num_warps, cfg.num_stages
        _launch_fwd_partial(
            (cdiv(N, block_m) * n_split,),
            (h_arg, w_arg, bias if bias is not None else h2, logits, tgt if tgt is not None else m, m, s, u,
             zt if zt is not None else m, tile_m, tile_s,
             N, vocab, D, temp_arg,
             h2.stride(0), h2.stride(1), weight.stride(0), weight.stride(1), logits.stride(0)),
            dict(HAS_BIAS=bias is not None, TEMP=temp_mode, IEEE=h2.dtype == torch.float32,
                 EVEN_D=D % cfg.block_k == 0, TMA=tma, SPLIT_V=cfg.split_v, BLOCK_M=block_m, BLOCK_V=cfg.block_v,
                 BLOCK_K=cfg.block_k, GROUP_M=group_m, STORE_TILES=pieces is not None, ENTROPY=entropy,
                 LOGITS=logits is not m, TARGET=tgt is not None),
            num_warps=num_warps, num_stages=num_stages,
        )
        return m, s, u, zt

    @staticmethod
    def finish(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, zt: torch.Tensor,
               tgt: torch.Tensor, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logp, entropy, lse) [N]: the splits merged in ascending order; tgt -1 gives 0s;
        without ``entropy`` it is NaN (not computed)."""
        N = zt.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=zt.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        if N:
            _launch_combine((cdiv(N, COMBINE_BLOCK),), (m, s, u, zt, tgt, logp, ent, lse, N, m.shape[0]),
                            dict(BLOCK=COMBINE_BLOCK, ENTROPY=entropy), num_warps=4, num_stages=DEFAULT_NUM_STAGES)
        return logp, ent, lse

    def forward(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor,
                temperature: float, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.finish(*self.statistics(h2, weight, bias, tgt, temperature, entropy=entropy), tgt, entropy)

    def grad_logits(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor,
                    lse: torch.Tensor, ent: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
                    temperature: float, v0: int, v1: int, out: torch.Tensor) -> None:
        N, D = h2.shape
        if N == 0 or v1 <= v0:
            return
        cfg = self._cfg(h2.dtype)
        bias = bias.contiguous() if bias is not None else None
        h_arg, w_arg, tma = self._operands(h2, weight, cfg)
        num_tiles = cdiv(N, cfg.block_m) * cdiv(v1 - v0, cfg.block_v)
        sms = sm_count(h2.device)
        grid = (min(num_tiles, sms) if cfg.persistent else num_tiles,)
        g_desc = tma and cfg.tma_store and tma_layout_ok(out)
        temp_arg, temp_mode = temperature_scaling(temperature, h2.device)
        g_arg = TensorDescriptor(out, list(out.shape), [out.stride(0), 1], [cfg.block_m, cfg.block_v]) if g_desc \
            else out
        _launch_grad_logits(
            grid,
            (h_arg, w_arg, bias if bias is not None else h2, tgt, lse, ent, g_logp,
             g_ent if g_ent is not None else g_logp, g_arg,
             N, weight.shape[0], D, v0, v1, temp_arg,
             h2.stride(0), h2.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1)),
            dict(HAS_BIAS=bias is not None, TEMP=temp_mode, HAS_GE=g_ent is not None, IEEE=h2.dtype == torch.float32,
                 EVEN_D=D % cfg.block_k == 0, TMA=tma, BLOCK_M=cfg.block_m, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
                 GROUP_M=cfg.group_m, PERSISTENT=cfg.persistent, NUM_SMS=sms, G_DESC=g_desc),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


# ---------------------------------------------------------------------------------------
# Autograd.
# ---------------------------------------------------------------------------------------

class LinearLogprobFunction(torch.autograd.Function):
    """(logp, entropy) [N] of rows h2 [N, D] against weight [V, D]; see the module doc."""

    @staticmethod
    def forward(ctx, h2, weight, bias, tgt, temperature: float,  # type: ignore[override]
                logprob_backend, gemm_backend, entropy: bool = True):
        # Without entropy its sums are skipped and the output is NaN: the caller drops it,
        # and the backward then never reads it (no gradient reaches an output not returned).
        logp, ent, lse = logprob_backend.forward(h2, weight, bias, tgt, temperature, entropy)
        ctx.save_for_backward(h2, weight, bias, tgt, lse, ent)
        ctx.temperature, ctx.logprob_backend, ctx.gemm_backend = temperature, logprob_backend, gemm_backend
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):  # type: ignore[override]
        saved = ctx.saved_tensors
        # The kernels compute first-order gradients only: never record them in a graph.
        with torch.no_grad():
            grads = LinearLogprobFunction._grads(ctx, saved, grad_logp, grad_ent)
        if not torch.is_grad_enabled():
            return grads
        # create_graph=True: the gradients must not pass for constants of the inputs (a
        # double backward through them would silently drop this op's second-order terms).
        deps = [t for t in (*saved[:3], grad_logp, grad_ent) if t is not None and t.requires_grad]
        outs = [g for g in grads if g is not None]
        if not deps or not outs:
            return grads
        wrapped = iter(_NoDoubleBackward.apply(len(outs), *outs, *deps))
        return tuple(next(wrapped) if g is not None else None for g in grads)

    @staticmethod
    def _grads(ctx, saved, grad_logp, grad_ent):
        h2, weight, bias, tgt, lse, ent = saved
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if grad_logp is None and grad_ent is None or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None, None
        N, D = h2.shape
        vocab = weight.shape[0]
        dev, acc_dt = h2.device, lse.dtype
        valid = tgt >= 0
        # Ignored rows get exactly zero upstream gradient (so g's row is exactly 0).
        zero = torch.zeros(N, dtype=acc_dt, device=dev)
        g_logp = torch.where(valid, grad_logp.to(acc_dt), zero) if grad_logp is not None else zero
        g_ent = torch.where(valid, grad_ent.to(acc_dt), zero) if grad_ent is not None else None
        logprob_backend, gemm_backend, T = ctx.logprob_backend, ctx.gemm_backend, ctx.temperature

        w_main = main_grad_target(OP, weight, (vocab, D), "weight", contiguous=True) if need_w else None
        b_main = main_grad_target(OP, bias, (vocab,), "bias", contiguous=True) if need_b else None
        dw = None
        if need_w and w_main is None:
            dw = torch.empty(vocab, D, dtype=weight.dtype, device=dev)
        db = (b_main if b_main is not None else torch.zeros(vocab, dtype=acc_dt, device=dev)) if need_b else None

        cv = backward_chunk(N, vocab, h2.element_size())
        tail = dw_tail_rows(N, D, vocab, cv, acc_dt, dw) if need_h else None
        if tail is not None:
            # The fp32 dH accumulator lives in dW's last rows, which the main loop leaves
            # alone; their dW waits until dH is final (from the last chunk's g, kept, or
            # a recomputed one).
            ratio = torch.finfo(acc_dt).bits // (8 * dw.element_size())  # dW elements per fp32
            start = tail * D  # 16-byte aligned (dw_tail_rows); the slice holds exactly N*D fp32
            dh_acc = dw.view(-1)[start:start + N * D * ratio].view(acc_dt).view(N, D)
            dh_acc.zero_()
            main_cv, dw_end, last = main_loop_chunk(cv, D), tail, last_chunk_start(vocab, cv)
        else:
            dh_acc = torch.zeros(N, D, dtype=acc_dt, device=dev) if need_h else None
            main_cv, dw_end, last = cv, vocab, vocab

        def grad_logits(g_buf: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
            g = g_buf[:, :v1 - v0]
            logprob_backend.grad_logits(h2, weight, bias, tgt, lse, ent, g_logp, g_ent, T, v0, v1, g)
            return g

        def weight_grads(g: torch.Tensor, v0: int, v1: int) -> None:
            rowsum = db[v0:v1] if need_b else None
            if need_w and D > 0:
                # dW[chunk]: one fp32 chain over all tokens (ascending), rounded once;
                # with main_grad the chain starts from it (Megatron convention).
                if w_main is not None:
                    gemm_backend.gemm(g.t(), h2, out=w_main[v0:v1], accumulate=True, rowsum=rowsum)
                else:
                    gemm_backend.gemm(g.t(), h2, out=dw[v0:v1], rowsum=rowsum)
            elif need_b:
                # With D = 0 there are no dW columns (the GEMM backend may skip an empty output and
                # its row sums with it): a zero [N, 1] operand carries the bias sums.
                gemm_backend.gemm(g.t(), h2[:, :1] if D > 0 else g.new_zeros(N, 1), out_dtype=acc_dt, rowsum=rowsum)

        def chunk(g_buf: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
            g = grad_logits(g_buf, v0, v1)
            if need_h:
                # dH chained over V ascending, chunk after chunk, in one fp32 accumulator.
                gemm_backend.gemm(g, weight[v0:v1], out=dh_acc, accumulate=True)
            if v0 < dw_end:
                # A column's dW depends on that column of g alone: any column range gives its bits.
                w1 = min(v1, dw_end)
                weight_grads(g[:, :w1 - v0], v0, w1)
            return g

        g_buf = None
        for v0, v1, g_offset in main_loop_schedule(last, main_cv, tail, N, D, h2.element_size()):
            if g_offset is not None:
                # g in dW's rows past this chunk, unwritten until a later chunk (or dH's end).
                chunk(dw.view(-1)[g_offset:g_offset + N * (v1 - v0)].view(N, v1 - v0), v0, v1)
                continue
            if g_buf is None:
                g_buf = torch.empty(N, min(main_cv, last - v0), dtype=h2.dtype, device=dev)
            chunk(g_buf, v0, v1)
        del g_buf  # freed before the last chunk's and the dH output's buffers (peak memory)
        g_last = chunk(torch.empty(N, vocab - last, dtype=h2.dtype, device=dev), last, vocab) if last < vocab \
            else None
        grad_h = dh_acc.to(h2.dtype) if need_h else None
        del dh_acc
        if dw_end < vocab:  # dH is final: the accumulator's rows of dW are free again
            kept = max(dw_end, last)
            weight_grads(g_last[:, kept - last:], kept, vocab)
            # The tail's columns before the last chunk: recomputed, in g_last's bytes (at
            # most Cv columns: one g chunk beside dhidden, the peak). Only a sliver of a
            # last chunk (tiny V or chunk) is swapped, after it is freed, for a wider one.
            rest = kept - dw_end
            if g_last.shape[1] >= min(cv // 2, rest):
                g_buf = g_last
                del g_last
            else:
                del g_last
                g_buf = torch.empty(N, min(cv, rest), dtype=h2.dtype, device=dev)
            for v0 in range(dw_end, kept, g_buf.shape[1]):
                v1 = min(kept, v0 + g_buf.shape[1])
                weight_grads(grad_logits(g_buf, v0, v1), v0, v1)
        grad_b = db.to(bias.dtype) if need_b and b_main is None else None
        return grad_h, dw, grad_b, None, None, None, None, None


class _NoDoubleBackward(torch.autograd.Function):
    """Passes linear_logprob's gradients through; differentiating them raises (see backward)."""

    @staticmethod
    def forward(ctx, n_out: int, *tensors):  # type: ignore[override]
        # The first n_out tensors are the gradients; the rest only put the inputs that
        # require grad upstream of them.
        return tuple(t.view_as(t) for t in tensors[:n_out])

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise RuntimeError(f"rlkernels.{OP}: double backward is not supported (its backward is computed by "
                           "fused kernels that are not themselves differentiable); differentiate a "
                           "logits-based log_softmax instead where second-order gradients are needed")


# ---------------------------------------------------------------------------------------
# Registry entries and the public function.
# ---------------------------------------------------------------------------------------

class _LinearLogprobBase(OpImpl):
    op_class = "linear_logprob"
    backend_impl: TorchLinearLogprobBackend | TritonLinearLogprobBackend

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, *, temperature: float = 1.0, ignore_index: int = -100,
                return_entropy: bool = False):
        return _run(hidden, weight, target, bias, temperature, ignore_index, return_entropy, self.backend)

    def forward_fp32(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                     bias: torch.Tensor | None = None, *, temperature: float = 1.0, ignore_index: int = -100,
                     return_entropy: bool = False):
        # Outputs are fp32 already (fp64 for fp64 inputs): the same path.
        return self.forward(hidden, weight, target, bias, temperature=temperature,
                            ignore_index=ignore_index, return_entropy=return_entropy)

    def invariance_case(self, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
        n, d, v = (33, 40, 257) if device.type == "cpu" else (256, 1024, 32003)
        hidden = torch.randn(n, d, generator=generator).to(device=device, dtype=dtype)
        weight = (torch.randn(v, d, generator=generator) / d ** 0.5).to(device=device, dtype=dtype)
        bias = torch.randn(v, generator=generator).to(device=device, dtype=dtype)
        target = torch.randint(0, v, (n,), generator=generator).to(device)
        target[::5] = -100

        def fn(rows: torch.Tensor):
            return self.forward(hidden[rows], weight, target[rows], bias, temperature=0.7, return_entropy=True)

        # Rows are indices into (hidden, target), so padding/shuffling moves both together.
        return fn, torch.arange(n, device=device)


@register(OP, "triton")
class LinearLogprobTriton(_LinearLogprobBase):
    backend_impl = TritonLinearLogprobBackend()


@register(OP, "torch")
class LinearLogprobTorch(_LinearLogprobBase):
    backend_impl = TorchLinearLogprobBackend()


def backends_for(op: str, hidden: torch.Tensor, backend: str | None = None):
    """(log-prob backend, GEMM backend) of the registry's ``linear_logprob`` backend for
    ``hidden``'s device (or ``backend``); refuses what that backend cannot run."""
    name, _ = select_backend(OP, hidden.device, backend)
    V_.refuse_interpreted_bf16(op, name, hidden)
    if name == "triton" and hidden.dtype == torch.float64:
        raise ValueError(f"rlkernels.{op}: float64 runs on the torch backend only (RLKERNELS_BACKEND=torch)")
    return implementation(OP, name).backend_impl, gemm_backend_for(hidden.device, name)


def _run(hidden, weight, target, bias, temperature, ignore_index, return_entropy, backend):
    V_.require_tensor(OP, "hidden", hidden)
    V_.require_tensor(OP, "weight", weight)
    if isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor) and hidden.is_floating_point() \
            and weight.is_floating_point():
        hidden, weight, bias = V_.autocast(hidden, weight, bias)
    validate(hidden, weight, target, bias, temperature, ignore_index)
    logprob_backend, gemm_backend = backends_for(OP, hidden, backend)
    lead = target.shape
    h2 = hidden.reshape(target.numel(), hidden.shape[-1])  # explicit N: -1 is ambiguous when D = 0
    t1 = target.reshape(-1).to(torch.int64)
    # Kernels see -1 for ignored rows (ignore_index may itself be a valid id in [0, V)).
    tgt = torch.where(t1 == ignore_index, torch.full_like(t1, -1), t1)
    logp, ent = LinearLogprobFunction.apply(h2, weight, bias, tgt, float(temperature), logprob_backend, gemm_backend,
                                            bool(return_entropy))
    logp, ent = logp.reshape(lead), ent.reshape(lead)
    return (logp, ent) if return_entropy else logp


@torch.compiler.disable
def linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                   bias: torch.Tensor | None = None, *, temperature: float = 1.0, ignore_index: int = -100,
                   return_entropy: bool = False, backend: str | None = None):
    """Per-token log-prob (and entropy) of ``target`` under ``softmax((hidden @ weight.T + bias) / T)``.

    hidden: [..., D] bf16/fp16/fp32 (fp64 on the torch backend); weight: [V, D]
    (lm_head layout); bias: [V] or None (same dtype/device); target: [...] integer ids
    in [0, V) or ``ignore_index``. Returns logp [...] fp32 (fp64 for fp64 inputs), or
    ``(logp, entropy)`` with ``return_entropy``; ignored positions give 0 and get zero
    gradient. Differentiable w.r.t. hidden, weight, bias. Never materializes [N, V];
    each row's outputs (and dhidden row) are bitwise independent of the rest of the batch.
    Empty inputs work as the matmul they stand for: no tokens give empty outputs; D = 0
    gives logits equal to the bias (all 0 without one, so logp = -log V).
    First-order gradients only: differentiating them again (double backward after
    ``create_graph=True``) raises RuntimeError.
    """
    return _run(hidden, weight, target, bias, temperature, ignore_index, return_entropy, backend)
