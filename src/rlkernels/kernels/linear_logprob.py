"""Kernels of the fused LM-head log-prob's backward: g = dL/d(logits), recomputing each
tile's logits. The forward's kernels are the LM head's statistics pass (``kernels.lm_head``).
Host side: ``rlkernels.ops.linear_logprob``."""
from __future__ import annotations

from ._triton import tl, triton
from .lm_head import keep_above, logits_tile, scale_by_temperature
from .tiles import grouped_tile

if triton is not None:

    @triton.jit
    def grad_logits_tile(
        h_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, g_ptr, threshold_ptr, tile_id,
        N, V, D, v0, v1, temperature, logit_scale, cap_arg, cap,
        stride_hn, stride_hd, stride_wv, stride_wd, stride_gn, stride_gv,
        HAS_BIAS: tl.constexpr, TEMP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
        HAS_GE: tl.constexpr, IEEE: tl.constexpr,
        EVEN_D: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, G_DESC: tl.constexpr, THRESHOLD: tl.constexpr,
    ):
        """g[:, v - v0] = dL/d(h W^T + b)[:, v] on one [BLOCK_M, BLOCK_V] tile, recomputing its logits.

        With G_DESC, g_ptr is a TMA descriptor over the chunk's [N, v1 - v0] columns.
        THRESHOLD: the gradient of the truncated distribution's log-prob (``keep_above``):
        0 on every logit left out, the target's too where it was left out. SCALE, CAP: the
        model's logit transform (``model_logits``), whose slope scale * (1 - tanh^2) g takes
        after the temperature's."""
        pid_m, pid_v = grouped_tile(tile_id, tl.cdiv(N, BLOCK_M), tl.cdiv(v1 - v0, BLOCK_V), GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rm = (offs_m % N).to(tl.int64)
        offs_v = v0 + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        z, tanh = logits_tile(h_ptr, w_ptr, b_ptr, rm, offs_v, pid_m * BLOCK_M, v0 + pid_v * BLOCK_V, V, D,
                              temperature, logit_scale, cap_arg, cap, stride_hn, stride_hd, stride_wv, stride_wd,
                              HAS_BIAS, TEMP, SCALE, CAP, IEEE, EVEN_D, TMA, BLOCK_M, BLOCK_V, BLOCK_K)
        z = keep_above(z, threshold_ptr, rm, THRESHOLD)
        lp = z - tl.load(lse_ptr + rm)[:, None]
        p = tl.exp(lp)
        gl = tl.load(gl_ptr + rm)  # already zero on ignored rows
        if HAS_GE:
            ge = tl.load(ge_ptr + rm)
            coef = gl[:, None] + ge[:, None] * (lp + tl.load(ent_ptr + rm)[:, None])
        else:
            coef = gl[:, None] + tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
        g = -(p * coef)
        tgt = tl.load(t_ptr + rm).to(tl.int32)
        g = tl.where(offs_v[None, :] == tgt[:, None], g + gl[:, None], g)
        if THRESHOLD:
            g = tl.where(z == float("-inf"), 0.0, g)  # p * coef is 0 * inf there
        g = scale_by_temperature(g, temperature, TEMP, BLOCK_M, BLOCK_V)
        if CAP != 0:
            g = g * (1.0 - tanh * tanh)
        if SCALE:
            g = g * logit_scale
        if G_DESC:
            # Through shared memory by TMA, clipped at the descriptor's [N, v1 - v0]: no
            # per-element pointers or masks in the epilogue's registers.
            g_ptr.store([pid_m * BLOCK_M, pid_v * BLOCK_V], g.to(g_ptr.dtype))
        else:
            # Tile base as one 64-bit scalar, in-tile offsets in 32 bits (BLOCK_M * stride_gn
            # is far below 2^31): fewer live 64-bit values in the epilogue.
            g_base = g_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_gn + (pid_v * BLOCK_V).to(tl.int64) * stride_gv
            loc_m = tl.arange(0, BLOCK_M)
            loc_v = tl.arange(0, BLOCK_V)
            mask = ((pid_m * BLOCK_M + loc_m)[:, None] < N) & ((offs_v < v1)[None, :])
            tl.store(g_base + loc_m[:, None] * stride_gn + loc_v[None, :] * stride_gv, g.to(g_ptr.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def grad_logits_kernel(
        h_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, g_ptr, threshold_ptr,
        N, V, D, v0, v1, temperature, logit_scale, cap_arg, cap,
        stride_hn, stride_hd, stride_wv, stride_wd, stride_gn, stride_gv,
        HAS_BIAS: tl.constexpr, TEMP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
        HAS_GE: tl.constexpr, IEEE: tl.constexpr,
        EVEN_D: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr,
        G_DESC: tl.constexpr, THRESHOLD: tl.constexpr,
    ):
        """g for the chunk [v0, v1): one tile per program, or NUM_SMS programs walking the
        tiles (a tile's arithmetic is the same whichever program computes it)."""
        if PERSISTENT:
            num_tiles = tl.cdiv(N, BLOCK_M) * tl.cdiv(v1 - v0, BLOCK_V)
            for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=False):
                grad_logits_tile(h_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, g_ptr, threshold_ptr,
                                  tile_id, N, V, D, v0, v1, temperature, logit_scale, cap_arg, cap,
                                  stride_hn, stride_hd, stride_wv, stride_wd, stride_gn, stride_gv,
                                  HAS_BIAS, TEMP, SCALE, CAP, HAS_GE, IEEE, EVEN_D, TMA, BLOCK_M, BLOCK_V, BLOCK_K,
                                  GROUP_M, G_DESC, THRESHOLD)
        else:
            grad_logits_tile(h_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, g_ptr, threshold_ptr,
                              tl.program_id(0), N, V, D, v0, v1, temperature, logit_scale, cap_arg, cap,
                              stride_hn, stride_hd, stride_wv, stride_wd, stride_gn, stride_gv,
                              HAS_BIAS, TEMP, SCALE, CAP, HAS_GE, IEEE, EVEN_D, TMA, BLOCK_M, BLOCK_V, BLOCK_K, GROUP_M,
                              G_DESC, THRESHOLD)
else:  # pragma: no cover - the torch backend still imports without Triton
    grad_logits_tile = grad_logits_kernel = None
