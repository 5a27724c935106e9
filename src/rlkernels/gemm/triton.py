"""The canonical K-chain GEMM in Triton: the host path (launch, layouts, launch plans).

Every output element is the fp32 accumulation of its dot product over K in
ascending order -- ``acc = tl.dot(a_blk, b_blk, acc)`` for k-blocks 0, 1, 2, ... --
with no split over K, rounded once at the end. On Hopper the bits of that chain
do not depend on the tile shape (the tensor cores step through K in fixed 16-wide
pieces whatever BLOCK_K is; measured: 22 configs and cuBLASLt without split-K
give identical bits), so the dispatch table may pick tiles by M without changing
a row's result; ``tests/ops/test_matmul.py`` proves it for every config here.

The same kernel serves every GEMM in the library:
  * forward / dX:  C = A @ B (+ bias), any strides, optional batch axis;
  * dW:            C += A @ B with A = dY^T, reduction over tokens, the fp32
                   accumulator loaded from C (``weight.main_grad``) so that
                   micro-batches chain exactly like one big batch;
  * dbias:         the row sums of A (= column sums of dY) through the same
                   tensor-core chain (a dot with a ones block), fused in.
"""
from __future__ import annotations


import torch


from ..kernels._triton import cdiv
from ..runtime import l2_window
from ..runtime.launcher import NO_FP_FUSION, cached_launcher, current_device, current_raw_stream, kept_launch_key, launch_with_key
from .tma import TmaPlan, tma_gemm_planned, tma_layouts
from ..kernels.gemm import gemm_group_kernel, gemm_kernel, gemm_silu_mul_kernel
from .table import GemmConfig, gemm_config, linear_group_config, silu_mul_config, swappable

try:
    from triton.runtime.errors import OutOfResources
except Exception:  # pragma: no cover - no Triton
    OutOfResources = RuntimeError

# Decode calls are host-bound: later launches skip Triton's binder (runtime.launcher). The
# five pointers come first in every call (bias and rowsum stand in as ``out`` when absent).
_launch_gemm = cached_launcher(gemm_kernel, leading_tensors=5) if gemm_kernel is not None else None
# The gated epilogue reproduces separately rounded ATen ops: no mul+add contraction.
_launch_gemm_silu_mul = (cached_launcher(gemm_silu_mul_kernel, leading_tensors=4, options=NO_FP_FUSION)
                         if gemm_silu_mul_kernel is not None else None)
_launch_gemm_group = cached_launcher(gemm_group_kernel, leading_tensors=8) if gemm_group_kernel is not None else None


MAX_GRID_BATCH = 65535  # CUDA's limit on grid axis 1, where the batch goes
# Problems with fewer rows than the tile mask the rows past M instead of re-reading
# rows 0..M-1 cyclically (see the kernel); the bits are the same either way
# (tests/gemm/test_triton.py). Where one program reads each B element (one row of tiles, no
# batch: a decode weight), B's bytes are a streaming L2 access-policy window during the
# launch (runtime.l2_window; RLKERNELS_L2_STREAMING=0 turns it off): a cache policy,
# never a value.

# TMA variants that failed to fit in shared memory, by (config, layouts, dtypes): they
# go straight to the pointer kernel afterwards.
_TMA_TOO_BIG: set[tuple] = set()


class LaunchPlan:
    """What :func:`triton_gemm` works out for a 2-D forward call before its launch -- the
    tile, the grid, the integer arguments, the constexprs, B's window span, the launcher's
    key -- kept under :func:`plan_key`, so that later calls with the same shapes, strides,
    dtypes and alignment launch the same kernel with the same arguments (but the tensors)
    without working it out again. Why: decode calls are host-bound; with plans
    ``rlkernels.linear`` takes 15-25% less host time per call (H100 host, plans on and off
    alternating in one process: docs/design/host_time.md). The
    kernel and its arguments are those the full path gives, so are the bits
    (tests/gemm/test_triton.py, tests/runtime/test_launcher.py). ``swap_block``: an fp32 swapped tile
    (C^T = B^T @ A^T), whose A^T copy is padded to whole tiles of this many tokens."""

    __slots__ = ("out_shape", "out_dtype", "b_as_kn", "grid", "ints", "constexprs", "num_warps", "num_stages",
                 "window_span", "launch_key", "swap_block")

    def __init__(self, out_shape: tuple[int, int], out_dtype: torch.dtype, b_as_kn: bool, grid: tuple[int, int],
                 ints: tuple, constexprs: dict, cfg: GemmConfig, window_span: int | None,
                 launch_key: tuple | None) -> None:
        self.out_shape, self.out_dtype, self.b_as_kn = out_shape, out_dtype, b_as_kn
        self.grid, self.ints, self.constexprs = grid, ints, constexprs
        self.num_warps, self.num_stages = cfg.num_warps, cfg.num_stages
        self.window_span, self.launch_key = window_span, launch_key
        self.swap_block = cfg.block_n if cfg.swap_ab else None

    def __call__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        result = out = a.new_empty(self.out_shape, dtype=self.out_dtype)
        if self.swap_block is not None:
            # The kernel's A is B^T: the weight as given where the full path viewed it as [K, N].
            a, b, out = b if self.b_as_kn else b.t(), transposed_tiles(a, self.swap_block), out.t()
        elif self.b_as_kn:
            b = b.t()
        _launch_pointer(self.grid, (a, b, out, out if bias is None else bias, out, *self.ints), self.constexprs,
                        self.num_warps, self.num_stages, b, self.window_span, self.launch_key)
        return result


def transposed_tiles(a: torch.Tensor, block: int) -> torch.Tensor:
    """A^T [K, M'] contiguous, M' = M rounded up to whole tiles of ``block`` tokens: the
    swapped kernel reads A^T's rows unwrapped, and the zero padding's products land in
    columns that are never stored."""
    M, K = a.shape
    m_pad = -(-M // block) * block
    if m_pad == M:
        return a.t().contiguous()
    a_t = a.new_zeros(K, m_pad)
    a_t[:, :M] = a.t()
    return a_t


# Launch plans by plan_key; bounded like the launcher's keys (one plan per problem shape).
# A call with an explicit ``config`` works everything out in full (no plan).
_PLANS: dict[tuple, LaunchPlan | TmaPlan] = {}
MAX_PLANS = 4096


def plan_key(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
             b_transposed: bool) -> tuple:
    """Everything a 2-D forward launch is worked out from: shapes and strides (the integer
    arguments, the tile), dtypes, the 16-byte alignment of each pointer (which Triton
    specializes on; a fresh output is always aligned), the current device (the
    launcher's key)."""
    return (a.shape, a.stride(), b.shape, b.stride(), b_transposed, a.dtype, b.dtype, out_dtype,
            None if bias is None else (bias.dtype, bias.data_ptr() & 15 == 0),
            a.data_ptr() & 15 == 0, b.data_ptr() & 15 == 0, current_device() if a.is_cuda else -1)


def _launch_pointer(grid: tuple[int, int], args: tuple, constexprs: dict, num_warps: int, num_stages: int,
                    b: torch.Tensor, window_span: int | None, launch_key: tuple | None = None) -> None:
    """The pointer kernel's launch; ``window_span``: B's bytes, to stream through L2 during
    it (None: no window)."""
    stream = saved = None
    if window_span is not None:
        stream = current_raw_stream(current_device())  # the launch's stream
        saved = l2_window.set_streaming(b, stream, span=window_span)
    try:
        launch_with_key(_launch_gemm, launch_key, grid, args, constexprs, num_warps=num_warps, num_stages=num_stages,
                        stream=stream)
    finally:
        if saved is not None:
            l2_window.restore(stream, saved)


def triton_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    rowsum: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    b_transposed: bool = False,
) -> torch.Tensor:
    """C = A @ B (+ bias) by the canonical K-chain; shapes already validated.

    a: [M, K] or [Bt, M, K]; b: [K, N] or [Bt, K, N] (a 2-D b is shared by every
    batch element, stride 0); any strides. With ``accumulate`` the fp32 ``out`` is
    the chain's starting value and is updated in place. ``rowsum`` (fp32 [M] or
    [Bt, M], contiguous) gets the row sums of A added, through the same chain.
    An fp32 config with ``swap_ab`` runs C^T = B^T @ A^T on a contiguous copy of A^T
    (same bits per element; 2-D operands with B k-contiguous only).
    ``b_transposed``: a 2-D b is given as B^T [N, K] (an nn.Linear weight); the pointer
    kernel reads it through swapped strides, other paths through a transposed view.
    """
    plan_id = None
    if (out is None and config is None and not accumulate and rowsum is None and a.dim() == 2
            and b.dim() == 2):
        plan_id = plan_key(a, b, bias, out_dtype, b_transposed)
        plan = _PLANS.get(plan_id)
        if plan is not None:
            return plan(a, b, bias)
    b_given = b
    # Strides read directly (a 2-D operand has batch stride 0): no views are made,
    # since every host microsecond shows at decode sizes.
    if a.dim() == 3:
        Bt, M, K = a.shape
        sab, sam, sak = a.stride()
    else:
        (M, K), Bt = a.shape, 1
        sab, (sam, sak) = 0, a.stride()
    if b_transposed:
        if b.dim() != 2:
            raise ValueError("rlkernels: b_transposed needs a 2-D b")
        N = b.shape[0]
        sbn, sbk = b.stride()
        sbb = 0
    else:
        N = b.shape[-1]
        sbb, sbk, sbn = (0, *b.stride()) if b.dim() == 2 else b.stride()
    if out is None:
        shape = (Bt, M, N) if a.dim() == 3 or b.dim() == 3 else (M, N)
        out = a.new_empty(shape, dtype=out_dtype or a.dtype)  # (no device object to build: host time)
    scb, scm, scn = (0, *out.stride()) if out.dim() == 2 else out.stride()
    if accumulate and out.dtype != torch.float32:
        raise ValueError("rlkernels: accumulation target must be float32")
    if M == 0 or N == 0 or Bt == 0:
        return out
    if K == 0:
        # An empty chain: its start value (0, or out's when accumulating), plus the bias.
        if not accumulate:
            out.zero_()
        if bias is not None:
            out += bias
        return out
    # The fp32 swap, TMA and batch-chunking paths take B as [K, N]: a view there (the
    # strides read above stay those of the view).
    if b_transposed and a.dtype == torch.float32:
        b, b_transposed = b.t(), False
    can_swap = a.dtype == torch.float32 and swappable(a, b, rowsum)
    cfg = config or gemm_config(M, N, a.dtype, token_reduction=accumulate or (sam == 1 and sak != 1),
                                swappable=can_swap, b_n_contiguous=not b_transposed and sbn == 1 and sbk != 1)
    if b_transposed and (cfg.tma or Bt > MAX_GRID_BATCH):
        b, b_transposed = b.t(), False
    b_as_kn = b is not b_given  # (what a launch plan repeats on the B it is given)
    if cfg.swap_ab:
        if not can_swap:
            raise ValueError(f"rlkernels: config {cfg.short()} needs 2-D fp32 operands with B k-contiguous")
        # C^T = B^T @ A^T: the same chain per element (fma(a, b, c) == fma(b, a, c)).
        result, (a, b, out) = out, (b.t(), transposed_tiles(a, cfg.block_n), out.t())
        M, N = N, M
        (sam, sak), (sbk, sbn), (scm, scn) = a.stride(), b.stride(), out.stride()
    layouts = tma_layouts(a, b, out) if cfg.tma and rowsum is None else None
    if layouts is not None:
        # The variant's identity: what decides its shared memory (layouts, epilogue, dtypes).
        key = (cfg, *layouts, accumulate, out.dtype, a.dtype)
        if key not in _TMA_TOO_BIG:
            try:
                out, tma_plan = tma_gemm_planned(a, b, cfg, bias=bias, out=out, accumulate=accumulate,
                                                 layouts=layouts,
                                                 plan_b_as_kn=None if plan_id is None else b_as_kn)
                if tma_plan is not None:
                    _keep_plan(plan_id, tma_plan)
                return out
            except OutOfResources:
                # Raised before launch (nothing written): some layout/epilogue variants need
                # more shared memory than the chip has (e.g. a warp-specialized tile with an
                # fp32 chained output). The pointer kernel with the same tile gives the same
                # bits (tests/gemm/test_tma.py).
                _TMA_TOO_BIG.add(key)
    if Bt > MAX_GRID_BATCH:
        # CUDA caps grid axis 1; batch elements are independent, so chunking the batch
        # changes no element's bits.
        for lo in range(0, Bt, MAX_GRID_BATCH):
            hi = min(Bt, lo + MAX_GRID_BATCH)
            b_part = b if b.dim() == 2 else b[lo:hi]
            rs_part = rowsum[lo:hi] if rowsum is not None and rowsum.dim() == 2 else rowsum
            triton_gemm(a[lo:hi], b_part, bias=bias, out=out[lo:hi], accumulate=accumulate, rowsum=rs_part,
                        config=cfg)
        return out
    grid = (cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n), Bt)
    args = (a, b, out, bias if bias is not None else out, rowsum if rowsum is not None else out,
            M, N, K, sab, sam, sak, sbb, sbk, sbn, scb, scm, scn)
    constexprs = dict(HAS_BIAS=bias is not None, ACC_FROM_C=accumulate, ROWSUM=rowsum is not None,
                      IEEE=a.dtype == torch.float32, EVEN_K=K % cfg.block_k == 0, MASK_M=M < cfg.block_m,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      SWAPPED=cfg.swap_ab)
    # One row of tiles: each B element is read by one program, once (a decode weight).
    # B's span from the strides at hand (2-D here: no batch axis).
    window_span = (((K - 1) * sbk + (N - 1) * sbn + 1) * b.element_size()
                   if M <= cfg.block_m and Bt == 1 and a.is_cuda else None)
    _launch_pointer(grid, args, constexprs, cfg.num_warps, cfg.num_stages, b, window_span)
    if plan_id is not None:
        launch_key = kept_launch_key(_launch_gemm, args, constexprs, cfg.num_warps, cfg.num_stages)
        _keep_plan(plan_id, LaunchPlan(tuple(result.shape if cfg.swap_ab else out.shape), out.dtype,
                                       b_as_kn, grid, args[5:], constexprs, cfg, window_span, launch_key))
    return result if cfg.swap_ab else out


def _keep_plan(plan_id: tuple, plan: LaunchPlan | TmaPlan) -> None:
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[plan_id] = plan


def triton_gemm_silu_mul(a: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, *,
                         config: GemmConfig | None = None) -> torch.Tensor:
    """``silu(a @ gate_weight^T) * (a @ up_weight^T)`` in one launch, with the bits of the two
    GEMMs' canonical chains and ``silu_mul``; shapes already validated.

    a: [M, K] (any strides); gate_weight, up_weight: [N, K] nn.Linear weights with the same
    strides; one 16-bit dtype (fp32 only under the interpreter, whose dot is numpy's).
    Returns [M, N]. ``config``: the tile (default: :func:`~rlkernels.gemm.table.silu_mul_config`).
    """
    M, K = a.shape
    N = gate_weight.shape[0]
    cfg = config or silu_mul_config(M, N, a.dtype)
    if cfg is None:
        raise ValueError(f"rlkernels: no gated GEMM tile for M={M}, N={N}, {a.dtype}")
    out = a.new_empty((M, N))
    if M == 0 or N == 0:
        return out
    sbn, sbk = gate_weight.stride()
    grid = (cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n),)
    args = (a, gate_weight, up_weight, out, M, N, K, *a.stride(), sbk, sbn, *out.stride())
    constexprs = dict(EVEN_K=K % cfg.block_k == 0, MASK_M=M < cfg.block_m, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)
    _launch_gemm_silu_mul(grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


MAX_GROUP = 3  # weights per grouped launch (gemm_group_kernel's members)


def triton_gemm_group(a: torch.Tensor, weights: tuple[torch.Tensor, ...], *, residual: torch.Tensor | None = None,
                      config: GemmConfig | None = None) -> tuple[torch.Tensor, ...]:
    """``tuple(a @ w^T for w in weights)`` in one launch, each with the bits of its own GEMM's
    canonical chain; shapes already validated.

    a: [M, K] (any strides); weights: 1 to MAX_GROUP [N_i, K] nn.Linear weights with the same
    strides, one 16-bit dtype (fp32 only under the interpreter, whose dot is numpy's).
    ``residual`` (one weight only): contiguous [M, N_0] of a's dtype, returned as
    ``residual + a @ w^T`` with the bits of torch's add after the GEMM.
    Returns contiguous [M, N_i] outputs. ``config``: the tile (default:
    :func:`~rlkernels.gemm.table.linear_group_config`)."""
    if not 1 <= len(weights) <= MAX_GROUP:
        raise ValueError(f"rlkernels: a grouped GEMM takes 1 to {MAX_GROUP} weights, got {len(weights)}")
    if residual is not None and len(weights) != 1:
        raise ValueError(f"rlkernels: a grouped GEMM adds a residual to one weight's output, got {len(weights)}")
    M, K = a.shape
    ns = [w.shape[0] for w in weights]
    cfg = config or linear_group_config(M, sum(ns), a.dtype)
    if cfg is None:
        raise ValueError(f"rlkernels: no grouped GEMM tile for M={M}, N={ns}, {a.dtype}")
    outs = tuple(a.new_empty((M, n)) for n in ns)
    if M == 0 or sum(ns) == 0:
        return outs
    pad = MAX_GROUP - len(weights)  # absent members: no columns, pointers never read
    ws, cs, ns = (*weights, *(weights[0],) * pad), (*outs, *(outs[0],) * pad), (*ns, *(0,) * pad)
    sbn, sbk = weights[0].stride()
    tiles = sum(cdiv(n, cfg.block_n) for n in ns)
    grid = (cdiv(M, cfg.block_m) * tiles,)
    args = (a, *ws, *cs, outs[0] if residual is None else residual, M, *ns, K, *a.stride(), sbk, sbn)
    constexprs = dict(RESIDUAL=residual is not None, EVEN_K=K % cfg.block_k == 0, MASK_M=M < cfg.block_m,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    _launch_gemm_group(grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return outs
