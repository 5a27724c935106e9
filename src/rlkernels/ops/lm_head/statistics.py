"""The LM head's forward statistics pass, on the torch and Triton backends.

For token rows ``h2`` [N, D] and a head ``weight`` [V, D] (``bias`` [V] or None), the pass
streams the logits ``z = (h W^T + b) / T`` in the LSE order (:mod:`.lse`: splits of
``LSE_SPLIT`` columns, tiles of ``LSE_TILE``) and keeps per row, never an [N, V] buffer:

* ``m``, the running max, and ``s = sum exp(z - m)`` (each tile's mass in fixed point);
* ``u = sum exp(z - m) * (z - m)``, the entropy's sum (skipped without ``entropy``);
* ``zt``, the target's logit.

:meth:`~TorchHeadStatistics.finish` turns them into (logp, entropy, lse), and ``forward``
is the two together: ``linear_logprob``'s forward, and each shard's in the vocab-parallel
op. The sampler runs the variant :meth:`~TorchHeadStatistics.tile_statistics`: no target
yet, and each vocabulary tile's running max and own mass recorded (:class:`TileRecord`)
for its first draw. Every tile and split boundary is a function of V alone, so a row's
statistics do not depend on the rest of the batch.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...gemm.chain import accumulator_dtype, chain_matmul
from ...kernels._triton import cdiv
from ...kernels.lm_head import fwd_partial_kernel, logprob_combine_kernel, scores_kernel
from ...runtime.launcher import DEFAULT_NUM_STAGES, cached_launcher
from ..matmul import gemm_backend_for
from .config import NO_TRANSFORM, FusedConfig, LogitTransform, fused_config, kernel_operands
from .lse import LSE_SPLIT, LSE_TILE, lse_step, merge_splits, tile_mass

# torch backend: token rows per step (memory only; every op is elementwise per row).
TORCH_ROW_CHUNK = 128
# Triton backend: rows per program of the combine.
COMBINE_BLOCK = 256

# The launches skip Triton's binder after their first call with a given key (runtime.launcher).
_launch_fwd_partial = cached_launcher(fwd_partial_kernel) if fwd_partial_kernel is not None else None
_launch_combine = cached_launcher(logprob_combine_kernel) if logprob_combine_kernel is not None else None
_launch_scores = cached_launcher(scores_kernel) if scores_kernel is not None else None
# Triton backend: columns per program of the scores kernel.
SCORES_BLOCK = 1024


class RowStatistics(NamedTuple):
    """The pass's output, read by the backend's ``finish``: running max ``m``, mass ``s``,
    entropy sum ``u`` (not the entropy's without ``entropy``), and the target logit ``zt``
    [N] (None from :meth:`~TorchHeadStatistics.tile_statistics`, which has no target).

    The torch backend's ``m``, ``s``, ``u`` are merged over the vocabulary, [N] in fp32
    (fp64 for fp64); the Triton backend's are per split, [n_split, N] fp32 (flat
    [n_split * N] where the caller gave the buffers), merged by its ``finish``."""

    m: torch.Tensor
    s: torch.Tensor
    u: torch.Tensor
    zt: torch.Tensor | None


class TileRecord(NamedTuple):
    """Per row and vocabulary tile (the LSE order's, ``n_tiles`` per row counting a last
    split's tiles past V): the running max after the tile, and the tile's own mass (its
    sum of exp(z - that max)). [N, n_tiles] on the torch backend; on the Triton backend
    flat buffers of at least N * n_tiles fp32, row-major."""

    running_max: torch.Tensor
    mass: torch.Tensor


def keep_above(z: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """``z`` [R, C] with each row's logits below ``threshold`` [R] set to -inf: the kept set
    {v : z_v >= tau} of a truncated distribution (``kernels.lm_head.keep_above``); z itself
    where ``threshold`` is None. A NaN logit is never below it."""
    if threshold is None:
        return z
    return torch.where(z < threshold.to(z.dtype)[:, None], -math.inf, z)


def model_logits(x: torch.Tensor, transform: LogitTransform) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's logits from raw ones ``x`` (fp32, or fp64), in place where it can: x *
    scale, then c * tanh(x / c) for a soft-cap c, as torch's ops on x's device compute them
    (``kernels.lm_head.model_logits``). Returns them and the tanh (None without a cap)."""
    if transform.scale != 1.0:
        x.mul_(transform.scale)
    if transform.softcap == 0.0:
        return x, None
    tanh = x.div_(transform.softcap).tanh_()
    return tanh * transform.softcap, tanh


def torch_logits(h_rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 v0: int, v1: int, temperature: float, transform: LogitTransform = NO_TRANSFORM, *,
                 return_tanh: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """z = transform(h W[v0:v1]^T + b) / T for a block of rows, fp32 (fp64 for fp64),
    ascending D-chain (:func:`model_logits`); / T is torch's own division by a Python float
    on that device (see :func:`~.config.temperature_scaling`). With ``return_tanh``, (z, the
    soft-cap's tanh or None)."""
    z = chain_matmul(h_rows, weight[v0:v1].t())
    if bias is not None:
        z.add_(bias[v0:v1].to(z.dtype))
    z, tanh = model_logits(z, transform)
    if temperature != 1.0:
        z.div_(temperature)
    return (z, tanh) if return_tanh else z


class TorchHeadStatistics:
    """The statistics pass as chained elementwise torch ops (any device): ascending chains
    and pairwise trees only, so a row's bits follow its own values."""

    name = "torch"

    def tile_v(self, dtype: torch.dtype) -> int:
        """The vocabulary tile a :class:`TileRecord` holds: the LSE order's tile."""
        return LSE_TILE

    @staticmethod
    def head_scores(h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                    transform: LogitTransform = NO_TRANSFORM) -> torch.Tensor:
        """z = transform(h2 W^T + b) / T [N, V], the scores this backend's pass computes,
        written out (fp32; fp64 for fp64)."""
        return torch_logits(h2, weight, bias, 0, weight.shape[0], temperature, transform)

    def n_tiles(self, vocab: int, dtype: torch.dtype) -> int:
        return cdiv(vocab, LSE_SPLIT) * (LSE_SPLIT // LSE_TILE)

    def statistics(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor,
                   temperature: float, entropy: bool = True, threshold: torch.Tensor | None = None,
                   transform: LogitTransform = NO_TRANSFORM) -> RowStatistics:
        """Each row's (m, s, u, zt) [N] over the whole vocabulary; ``tgt`` [N] int64 ids (-1
        where there is none: zt is then 0). ``threshold`` [N] (the accumulator dtype): the
        truncated distribution's, each row's logits below it left out (:func:`keep_above`).
        ``transform``: the model's logits from the raw ones (:func:`model_logits`)."""
        return self._pass(h2, weight, bias, tgt, temperature, entropy, None, threshold, transform)

    def tile_statistics(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        temperature: float, tiles: TileRecord, entropy: bool = True,
                        threshold: torch.Tensor | None = None,
                        transform: LogitTransform = NO_TRANSFORM) -> RowStatistics:
        """The sampler's pass: (m, s, u) as :meth:`statistics` gives them (zt None: no target
        yet), and every tile's running max and mass written into ``tiles`` [N, n_tiles]."""
        return self._pass(h2, weight, bias, None, temperature, entropy, tiles, threshold, transform)

    def _pass(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor | None,
              temperature: float, entropy: bool, tiles: TileRecord | None,
              threshold: torch.Tensor | None, transform: LogitTransform) -> RowStatistics:
        N = h2.shape[0]
        vocab = weight.shape[0]
        adt = accumulator_dtype(h2.dtype)
        dev = h2.device
        n_split = cdiv(vocab, LSE_SPLIT)
        per_split = LSE_SPLIT // LSE_TILE
        m = torch.empty(N, dtype=adt, device=dev)
        s, u = torch.empty_like(m), torch.empty_like(m)
        zt = torch.empty_like(m) if tgt is not None else None
        for r0 in range(0, N, TORCH_ROW_CHUNK):
            rows = slice(r0, r0 + TORCH_ROW_CHUNK)
            h_rows = h2[rows]
            R = h_rows.shape[0]
            parts = torch.empty(3, n_split, R, dtype=adt, device=dev)  # per-split m, s, u
            ztr = torch.zeros(R, dtype=adt, device=dev)
            for k in range(n_split):
                v0, v1 = k * LSE_SPLIT, min(vocab, (k + 1) * LSE_SPLIT)
                z_split = keep_above(torch_logits(h_rows, weight, bias, v0, v1, temperature, transform),
                                     None if threshold is None else threshold[rows])
                mr = torch.full((R,), -math.inf, dtype=adt, device=dev)
                sr = torch.zeros(R, dtype=adt, device=dev)
                ur = torch.zeros(R, dtype=adt, device=dev)
                for i, c0 in enumerate(range(0, v1 - v0, LSE_TILE)):
                    z = z_split[:, c0:c0 + LSE_TILE]
                    m_new, m_ref, alpha, e, d, mass, s_new = lse_step(mr, sr, z)
                    # u = sum e^(z-m) (z-m), kept relative to the running max: rescaled by
                    # alpha * (u + (m_old - m_new) s); 0 before the first tile (s == 0).
                    if entropy:
                        ed = e * d if threshold is None else e * torch.where(z == -math.inf, 0.0, d)
                        ur = torch.where(sr > 0, alpha * (ur + (mr - m_ref) * sr), torch.zeros_like(ur)) \
                            + tile_mass(ed)
                    mr, sr = m_new, s_new
                    if tiles is not None:
                        tiles.running_max[rows, k * per_split + i] = mr
                        tiles.mass[rows, k * per_split + i] = mass
                if tgt is not None:
                    t = tgt[rows]
                    inside = (t >= v0) & (t < v1)
                    picked = z_split.gather(1, (t - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0]
                    ztr = torch.where(inside, picked, ztr)
                parts[0, k], parts[1, k], parts[2, k] = mr, sr, ur
            m[rows], s[rows], u[rows] = merge_splits(parts[0], parts[1], parts[2])
            if zt is not None:
                zt[rows] = ztr
        return RowStatistics(m, s, u, zt)

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
                temperature: float, entropy: bool = True, threshold: torch.Tensor | None = None,
                transform: LogitTransform = NO_TRANSFORM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logp, entropy, lse) [N] in fp32 (fp64 for fp64 inputs); tgt is -1 where ignored;
        without ``entropy`` the entropy is NaN and its sums are skipped. ``threshold`` [N]:
        those of the truncated distribution (:meth:`statistics`)."""
        return self.finish(*self.statistics(h2, weight, bias, tgt, temperature, entropy, threshold, transform),
                           tgt, entropy)


class TritonHeadStatistics:
    """The statistics pass as Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1), with
    ``config`` or the dtype's checked-in :func:`~.config.fused_config`."""

    name = "triton"

    def __init__(self, config: FusedConfig | None = None) -> None:
        self.config = config

    def config_for(self, dtype: torch.dtype) -> FusedConfig:
        """The tile config the kernels launch with for ``dtype``."""
        return self.config or fused_config(dtype)

    def tile_v(self, dtype: torch.dtype) -> int:
        """The vocabulary tile a :class:`TileRecord` holds: the config's tile."""
        return self.config_for(dtype).block_v

    def n_tiles(self, vocab: int, dtype: torch.dtype) -> int:
        cfg = self.config_for(dtype)
        return cdiv(vocab, cfg.split_v) * (cfg.split_v // cfg.block_v)

    def statistics(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor,
                   temperature: float, entropy: bool = True, threshold: torch.Tensor | None = None,
                   transform: LogitTransform = NO_TRANSFORM, logits: torch.Tensor | None = None) -> RowStatistics:
        """Per-split (m, s, u) [n_split, N] (u is 0 without ``entropy``) and zt [N]; ``tgt``
        [N] int64 ids (-1 where there is none). ``threshold`` [N] fp32: the truncated
        distribution's (``kernels.lm_head.keep_above``). ``transform``: the model's logits
        from the raw ones (``kernels.lm_head.model_logits``). ``logits``: the raw logits
        [N, V] fp32 already computed by the GEMM backend (read instead of computed; same bits)."""
        return self._pass(h2, weight, bias, tgt, temperature, entropy, None, None, threshold, transform, logits)

    def tile_statistics(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        temperature: float, tiles: TileRecord, entropy: bool = True,
                        partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        threshold: torch.Tensor | None = None, transform: LogitTransform = NO_TRANSFORM,
                        logits: torch.Tensor | None = None, tile_max: torch.Tensor | None = None) -> RowStatistics:
        """The sampler's pass: per-split (m, s, u) as :meth:`statistics` gives them (zt None:
        no target yet, and its kernel code is compiled out), and every tile's running max
        and mass written into ``tiles`` (``STORE_TILES``). ``partials``: flat (m, s, u)
        buffers of n_split * N fp32 to fill instead of new ones (the sampler carves them and
        ``tiles`` from one allocation). ``tile_max`` [N, ceil(V / LSE_TILE)] fp32, with
        ``logits`` and ``threshold``: each tile's largest score (NaN where it holds a NaN);
        the pass does not read a row's tiles wholly below its threshold (same bits)."""
        return self._pass(h2, weight, bias, None, temperature, entropy, tiles, partials, threshold, transform, logits,
                          tile_max)

    def raw_logits(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """h2 W^T + b [N, V] fp32 by the GEMM backend: the logits the pass reads at N <=
        ``small_n`` (the fused tiles' canonical chain, the same bits)."""
        bias = bias.contiguous() if bias is not None else None
        return gemm_backend_for(h2.device, "triton").gemm(h2, weight, bias=bias, out_dtype=torch.float32,
                                                          b_transposed=True)

    def head_scores(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                    transform: LogitTransform = NO_TRANSFORM) -> torch.Tensor:
        """z = transform(h2 W^T + b) / T [N, V] fp32, the scores this backend's pass computes,
        written out: :meth:`raw_logits`, then :meth:`scores`."""
        return self.scores(self.raw_logits(h2, weight, bias), temperature, transform)

    @staticmethod
    def scores(raw: torch.Tensor, temperature: float, transform: LogitTransform = NO_TRANSFORM) -> torch.Tensor:
        """z = transform(raw) / T [N, V] fp32 from :meth:`raw_logits`, by the kernels' own
        steps (``kernels.lm_head.scores_kernel``): the scores every kernel of the pass
        computes, whole. ``raw`` itself where there is nothing to apply."""
        if temperature == 1.0 and transform.neutral:
            return raw
        N, V = raw.shape
        z = torch.empty_like(raw)
        if N:
            score_args, score_modes = transform.launch_args(temperature, raw.device)
            _launch_scores((N, cdiv(V, SCORES_BLOCK)), (raw, z, N, V, raw.stride(0), z.stride(0), *score_args),
                           dict(**score_modes, BLOCK_V=SCORES_BLOCK), num_warps=4, num_stages=DEFAULT_NUM_STAGES)
        return z

    def _pass(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor | None,
              temperature: float, entropy: bool, tiles: TileRecord | None,
              partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
              threshold: torch.Tensor | None = None, transform: LogitTransform = NO_TRANSFORM,
              logits: torch.Tensor | None = None, tile_max: torch.Tensor | None = None) -> RowStatistics:
        N, D = h2.shape
        vocab = weight.shape[0]
        dev = h2.device
        cfg = self.config_for(h2.dtype)
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
            return RowStatistics(m, s, u, zt)
        bias = bias.contiguous() if bias is not None else None  # the kernels index it with unit stride
        score_args, score_modes = transform.launch_args(temperature, h2.device)
        tile_m, tile_s = tiles if tiles is not None else (m, m)
        skip = tile_max is not None and logits is not None and threshold is not None
        if skip and tuple(tile_max.shape) != (N, cdiv(vocab, LSE_TILE)):
            raise ValueError(f"rlkernels: tile_max must be [N, ceil(V / {LSE_TILE})] = [{N}, {cdiv(vocab, LSE_TILE)}], "
                             f"got {tuple(tile_max.shape)}")
        if logits is not None or N <= cfg.small_n:
            if logits is None:
                logits = self.raw_logits(h2, weight, bias)
            h_arg, w_arg, tma, block_m, group_m = h2, weight, False, cfg.small_block_m, 1
            num_warps, num_stages = 4, 2
        else:
            logits = m  # unread
            h_arg, w_arg, tma = kernel_operands(h2, weight, cfg)
            block_m, group_m, num_warps, num_stages = cfg.block_m, cfg.group_m, cfg.num_warps, cfg.num_stages
        _launch_fwd_partial(
            (cdiv(N, block_m) * n_split,),
            (h_arg, w_arg, bias if bias is not None else h2, logits, tgt if tgt is not None else m, m, s, u,
             zt if zt is not None else m, tile_m, tile_s, threshold if threshold is not None else m,
             tile_max if skip else m, N, vocab, D, *score_args,
             h2.stride(0), h2.stride(1), weight.stride(0), weight.stride(1), logits.stride(0)),
            dict(HAS_BIAS=bias is not None, **score_modes, IEEE=h2.dtype == torch.float32,
                 EVEN_D=D % cfg.block_k == 0, TMA=tma, SPLIT_V=cfg.split_v, BLOCK_M=block_m, BLOCK_V=cfg.block_v,
                 BLOCK_K=cfg.block_k, GROUP_M=group_m, STORE_TILES=tiles is not None, ENTROPY=entropy,
                 LOGITS=logits is not m, TARGET=tgt is not None, THRESHOLD=threshold is not None, SKIP=skip),
            num_warps=num_warps, num_stages=num_stages,
        )
        return RowStatistics(m, s, u, zt)

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
                temperature: float, entropy: bool = True, threshold: torch.Tensor | None = None,
                transform: LogitTransform = NO_TRANSFORM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logp, entropy, lse) [N] fp32; tgt is -1 where ignored; without ``entropy`` the
        entropy is NaN and its sums are skipped. ``threshold`` [N]: those of the truncated
        distribution (:meth:`statistics`)."""
        return self.finish(*self.statistics(h2, weight, bias, tgt, temperature, entropy, threshold, transform),
                           tgt, entropy)
