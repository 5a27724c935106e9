"""The LSE order: one fixed order for the log-sum-exp of a row of logits.

Every op that reports or draws from the token distribution (``linear_logprob``,
``linear_sample``, ``log_softmax`` of fp32 logits) reduces a row of R values in this
order, a function of R alone:

* splits of :data:`LSE_SPLIT` columns from column 0, each reduced on its own;
* inside a split, tiles of :data:`LSE_TILE` columns in ascending order, keeping the
  running max ``m`` and ``s = sum e^(z - m)``; a tile's own mass (its sum of
  e^(z - m) at the running max after it) is summed in fixed point (:func:`tile_mass`),
  which is exact, so it has one value whatever order or register layout the sum takes;
* the splits merged in ascending order (:func:`merge_mass`).

The fixed-point sum is what lets a GEMM epilogue (the LM head's fused statistics pass,
whose tile layout follows its config) and a plain row kernel (``log_softmax``) give the
same bits: an fp32 ``tl.sum`` follows the register layout. Host side:
``rlkernels.ops.lm_head.lse``.
"""
from __future__ import annotations

from ._triton import tl, triton

LSE_TILE = 256
LSE_SPLIT = 2048
# e in [-1, 1] is summed as integers of e * 2^52 (truncated toward 0): at most
# LSE_TILE * 2^52 = 2^60 in magnitude per tile, below int64's 2^63. The truncation costs
# at most 2^-52 per element, against a mass of at least 1 at the row's max.
MASS_SCALE = 2.0 ** 52
MASS_UNIT = 2.0 ** -52

if triton is not None:

    @triton.jit
    def tile_mass(e):
        """sum over axis 1 of ``e`` [ROWS, LSE_TILE] (fp32 in [-1, 1]), in fixed point: exact,
        so independent of the order and layout of the sum; NaN in a row makes its sum NaN."""
        q = (e * 4503599627370496.0).to(tl.int64)
        mass = tl.sum(q, axis=1).to(tl.float32) * 2.220446049250313e-16
        # e * 0 is 0, or NaN where e is: that sum is exact too.
        return mass + tl.sum(e * 0.0, axis=1)

    @triton.jit
    def lse_step(m_i, s_i, z):
        """One tile of the chain: (m_new, m_ref, alpha, e, d, mass, s_new) for rows with
        running (m_i, s_i) after the logits ``z`` [ROWS, LSE_TILE] (-inf where absent).

        m_ref is the max the tile's e = e^(z - m_ref) is taken against (0 while a row has
        seen only -inf, so it never subtracts -inf from -inf); alpha rescales s_i to it."""
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = z - m_ref[:, None]
        e = tl.exp(d)
        alpha = tl.exp(m_i - m_ref)
        mass = tile_mass(e)
        s_new = alpha * s_i + mass
        return m_new, m_ref, alpha, e, d, mass, s_new

    @triton.jit
    def merge_mass(s, a, s_k):
        """The merged mass after split k: s + a * s_k, with a = e^(m_k - max over splits)."""
        return s + a * s_k

    @triton.jit
    def lse_partial_kernel(x_ptr, m_ptr, s_ptr, M, R, stride_x,
                           ROWS: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr):
        """(m, s) [n_split, M] of ROWS rows of ``x`` [M, R] over one split (grid: row blocks x splits)."""
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_m * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        base = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        v_start = pid_s * SPLIT
        m_i = tl.full((ROWS,), float("-inf"), tl.float32)
        s_i = tl.zeros((ROWS,), tl.float32)
        for j in range(0, tl.cdiv(tl.minimum(R - v_start, SPLIT), TILE)):
            cols = v_start + j * TILE + tl.arange(0, TILE)
            ok = row_ok[:, None] & (cols < R)[None, :]
            z = tl.load(base + cols[None, :].to(tl.int64), mask=ok, other=float("-inf")).to(tl.float32)
            m_i, m_ref, alpha, e, d, mass, s_i = lse_step(m_i, s_i, z)
        part = pid_s.to(tl.int64) * M + rows
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(s_ptr + part, s_i, mask=row_ok)

    @triton.jit
    def log_softmax_out_kernel(x_ptr, m_ptr, s_ptr, out_ptr, M, R, n_split, stride_x, stride_o,
                               ROWS: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr):
        """out = (x - max) - log(mass) over one split of ROWS rows, the splits' (m, s) merged
        in ascending order as ``linear_logprob``'s combine merges them."""
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_m * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        mx = tl.full((ROWS,), float("-inf"), tl.float32)
        m_ptrs = m_ptr + rows64  # advanced by M per split: 64-bit pointers, no int32 k * M
        for k in range(0, n_split):
            mx = tl.maximum(mx, tl.load(m_ptrs, mask=row_ok, other=0.0))
            m_ptrs += M
        s = tl.zeros((ROWS,), tl.float32)
        m_ptrs = m_ptr + rows64
        s_ptrs = s_ptr + rows64
        for k in range(0, n_split):
            mk = tl.load(m_ptrs, mask=row_ok, other=0.0)
            sk = tl.load(s_ptrs, mask=row_ok, other=1.0)
            s = merge_mass(s, tl.exp(mk - mx), sk)
            m_ptrs += M
            s_ptrs += M
        log_s = tl.log(s)
        v_start = pid_s * SPLIT
        x_base = x_ptr + rows64[:, None] * stride_x
        o_base = out_ptr + rows64[:, None] * stride_o
        for j in range(0, tl.cdiv(tl.minimum(R - v_start, SPLIT), TILE)):
            cols = v_start + j * TILE + tl.arange(0, TILE)
            ok = row_ok[:, None] & (cols < R)[None, :]
            z = tl.load(x_base + cols[None, :].to(tl.int64), mask=ok, other=0.0).to(tl.float32)
            out = (z - mx[:, None]) - log_s[:, None]
            tl.store(o_base + cols[None, :].to(tl.int64), out.to(out_ptr.dtype.element_ty), mask=ok)
else:  # pragma: no cover - the torch backend still imports without Triton
    tile_mass = lse_step = merge_mass = lse_partial_kernel = log_softmax_out_kernel = None
