"""Warp-specialized Hopper forward of the batch-invariant attention (Gluon; host code:
``rlkernels.ops.attention.ws_host``).

It computes ``kernels.attention``'s chain for every row -- key blocks of BLOCK_N from key
0 ascending, splits of S_SPLIT keys each from the empty state, merged in ascending order
-- with the same expressions and the same instructions: QK^T and P@V as wgmma chains
with fp32 accumulators (k ascending), the row sums of p through ``mma.sync m16n8k16``
against a ones matrix (what Triton lowers ``tl.dot(p, ones[BLOCK_N, 8])`` to), exp2 as
``ex2.approx.ftz``, no FMA contraction. So its outputs and LSE equal ``attn_fwd_kernel``'s
bit for bit, and with them the decode (split-KV) path's; GPU tests compare every bit.

What changes is who does what. A tile is CONSUMERS x 64 query rows of one (sequence,
query head); the kernel is persistent: one CTA per SM takes tile after tile. CONSUMERS
consumer warpgroups of 64 rows each (the default partition and workers) compute a tile
(two at D = 128; three at D = 64, where a block's exponentials take as long as its MMAs
and a third softmax in flight keeps the tensor cores fed), and a one-warp producer
streams its K/V blocks through STAGES shared-memory stages by TMA, running on
into the next tile's blocks while the consumers finish a tile's output. Each consumer
waits on mbarriers alone, so one's softmax can run while another's MMAs hold the
tensor cores; within a consumer, block i's QK^T is in flight with block i-1's P@V.
Tiles go to CTAs in rounds, longest causal tiles first, in a snake (``_tile_of_round``),
which balances the CTAs' work. Which CTA takes a tile and its 64-row split between the
consumers are launch detail: a row's bits depend on its keys' blocks, not on its tile
(see ``kernels.attention``).

Operands come through TMA: q and out as row views [tokens, Hq * D] (64-row tiles),
k and v as 3-D views [planes, slots, cols] -- key j of sequence b, head h at row
k_start + j of plane b * XB + h * XH, column h * XC -- so heads side by side in a token
(XB, XH, XC) = (1, 0, D), Hugging Face's head planes (H, 1, 0) and one packed run of
rows (XB = 0) are all read in place. A block's keys past the sequence are masked out of
the scores; their values must be exact zeros too (a free cache slot may hold NaN): TMA
zero-fills rows past a plane's slots, and a last block that runs into other rows of the
tensor is read again through masked pointer loads. Query tiles end at a sequence's last
row, so a partial tile holds its first rows (the shortest causal walk); rows before the
sequence's first are stored through masked pointers, whole tiles by TMA from a staging
tile of their own, so a tile's store need not finish before the next tile's work starts.
"""
from __future__ import annotations

from .._triton import gl, gluon

try:
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except Exception:  # pragma: no cover - a Gluon without the Hopper ops
    gluon = None

# Rows per consumer warpgroup (one wgmma M) and the columns of the ones matrix the row
# sums go through (kernels.attention.softmax.ROWSUM_COLS with Triton >= 3.5).
WG_ROWS = 64
ROWSUM_COLS = 8
# Registers: the producer's warpgroup keeps PRODUCER_REGS per thread and the consumer
# warpgroups share the rest of the SM's register file (setmaxnreg counts in steps of 8).
REGISTER_FILE = 65536
PRODUCER_REGS = 24


def launch_registers(consumers: int) -> int:
    """The launch's maxnreg: the consumers' warpgroups and the producer's, 128 threads
    each, fill the register file until setmaxnreg moves the producer's to the consumers."""
    return REGISTER_FILE // ((consumers + 1) * 128) // 8 * 8


def consumer_registers(consumers: int) -> int:
    """Registers per thread of each consumer warpgroup (the kernel's CONSUMER_REGS)."""
    return (REGISTER_FILE - 128 * PRODUCER_REGS) // (consumers * 128) // 8 * 8


if gluon is not None:
    _WG_ROWS = gl.constexpr(WG_ROWS)
    _ROWSUM_COLS = gl.constexpr(ROWSUM_COLS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    @gluon.jit
    def _merge(m1, l1, acc1, m2, l2, acc2, ROW_O: gl.constexpr):
        """kernels.attention.softmax.merge_states."""
        m = gl.maximum(m1, m2)
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        a1 = gl.exp2(m1 - m_safe)
        a2 = gl.exp2(m2 - m_safe)
        l = gl.fma(l1, a1, l2 * a2)
        acc = gl.fma(acc1, gl.convert_layout(a1, ROW_O)[:, None], acc2 * gl.convert_layout(a2, ROW_O)[:, None])
        return m, l, acc

    @gluon.jit
    def _softmax(s, m_s, l_s, qk_scale, ones, R_LAYOUT: gl.constexpr, PR_LAYOUT: gl.constexpr,
                 ROW_S: gl.constexpr):
        """kernels.attention.softmax.block_step's softmax half: (p, alpha, m, l) of one block."""
        m_new = gl.maximum(m_s, gl.max(s, 1) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_s - m_safe)
        p = gl.exp2(gl.fma(s, qk_scale, -m_safe[:, None])).to(ones.dtype)
        rows = mma_v2(gl.convert_layout(p, PR_LAYOUT), ones,
                      gl.zeros([p.shape[0], ones.shape[1]], gl.float32, R_LAYOUT))
        l_new = gl.fma(l_s, alpha, gl.convert_layout(gl.max(rows, 1), ROW_S))
        return p, alpha, m_new, l_new

    @gluon.jit
    def _mask(s, n0, q0, LQ, LK, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, ROW_S: gl.constexpr,
              COL_S: gl.constexpr):
        """-inf where key n0 + j is past the sequence, row q0 + i is, or (causal) the key
        lies after the row's position LK - LQ + q0 + i: split_walk's valid mask."""
        rows = q0 + gl.arange(0, s.shape[0], layout=ROW_S)
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=COL_S)
        valid = (offs_n < LK)[None, :] & (rows < LQ)[:, None]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= (LK - LQ + rows)[:, None])
        return gl.where(valid, s, float("-inf"))

    @gluon.jit
    def _block(i, c0, qs, k_smem, v_smem, k_ready, v_ready, kv_empty, m, l, acc, m_s, l_s, acc_s, p, alpha, s_zero,
               ones, qk_scale, q0, LQ, LK, MASK: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_D: gl.constexpr, STAGES: gl.constexpr, SPLIT_BLOCKS: gl.constexpr, O_LAYOUT: gl.constexpr,
               R_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr, PR_LAYOUT: gl.constexpr, ROW_S: gl.constexpr,
               COL_S: gl.constexpr, ROW_O: gl.constexpr):
        """Block i >= 1 of a tile whose block 0 is the program's block c0 (stage and phase
        count on across tiles): its QK^T goes out with block i-1's P@V, its softmax runs
        while the P@V does; the P@V is retired (and its stage released) before returning. A
        block that starts a split first hands the finished split to the merge (after its P@V)."""
        c = c0 + i
        st = c % STAGES
        pst = (c - 1) % STAGES
        boundary = i % SPLIT_BLOCKS == 0
        m_old = m_s
        l_old = l_s
        if boundary:
            m_s = gl.full([_WG_ROWS], float("-inf"), gl.float32, ROW_S)
            l_s = gl.zeros([_WG_ROWS], gl.float32, ROW_S)
        mbarrier.wait(k_ready.index(st), (c // STAGES) & 1)
        s = warpgroup_mma(qs, k_smem.index(st).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(pst), ((c - 1) // STAGES) & 1)
        acc_s = acc_s * gl.convert_layout(alpha, ROW_O)[:, None]
        p_op = gl.convert_layout(p, P_LAYOUT)
        acc_s = warpgroup_mma(p_op, v_smem.index(pst).reshape([BLOCK_N, BLOCK_D]), acc_s, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))
        if MASK:
            s = _mask(s, i * BLOCK_N, q0, LQ, LK, CAUSAL, BLOCK_N, ROW_S, COL_S)
        p, alpha, m_s, l_s = _softmax(s, m_s, l_s, qk_scale, ones, R_LAYOUT, PR_LAYOUT, ROW_S)
        acc_s, p_op = warpgroup_mma_wait(0, deps=(acc_s, p_op))
        mbarrier.arrive(kv_empty.index(pst), count=1)
        if boundary:
            m, l, acc = _merge(m, l, acc, m_old, l_old, acc_s, ROW_O)
            acc_s = gl.zeros([_WG_ROWS, BLOCK_D], gl.float32, O_LAYOUT)
        return m, l, acc, m_s, l_s, acc_s, p, alpha

    @gluon.jit
    def _bounds(b, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, LK, DENSE: gl.constexpr):
        """kernels.attention.prologue.seq_bounds: (q_start, q_len, k_start, k_len) of sequence b; DENSE:
        a padded batch (sequence b's LQ queries from row b * LQ over its LK keys)."""
        if DENSE:
            return b.to(gl.int64) * LQ, LQ, b * 0, LK
        else:
            return (gl.load(q_start_ptr + b).to(gl.int64), gl.load(q_len_ptr + b), gl.load(k_start_ptr + b),
                    gl.load(k_len_ptr + b))

    @gluon.jit
    def _store_rows(o_ptr, out, row0, lo, hi, stride_ot, col0, O_LAYOUT: gl.constexpr):
        """Rows lo .. hi - 1 of the tile to o_ptr rows row0 + i, columns col0 + j."""
        rows = gl.arange(0, out.shape[0], layout=gl.SliceLayout(1, O_LAYOUT))
        cols = gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, O_LAYOUT))
        ptrs = o_ptr + (row0 + rows.to(gl.int64))[:, None] * stride_ot + (col0 + cols)[None, :]
        gl.store(ptrs, out, mask=((rows >= lo) & (rows < hi))[:, None])

    @gluon.jit
    def _zeroed_value_block(v_ptr, v_fix, row0, n_valid, stride_vt, col0, BLOCK_N: gl.constexpr,
                            BLOCK_D: gl.constexpr):
        """The value block whose keys run past the sequence, its rows n_valid.. zero (the
        rows TMA would read belong to another sequence or a free cache slot: NaN must not
        leak), staged in v_fix for the P@V."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, layout))
        ptrs = v_ptr + (row0 + rows.to(gl.int64))[:, None] * stride_vt + (col0 + cols)[None, :]
        v_fix.store(gl.load(ptrs, mask=(rows < n_valid)[:, None], other=0.0))
        fence_async_shared()
        return v_fix

    @gluon.jit
    def _tile_of_round(j):
        """The program's tile in round j: programs take rounds of consecutive tiles, in
        program order in even rounds and in reverse in odd ones (a snake), so the program
        that took the longest tile of a round takes the shortest of the next."""
        programs = gl.num_programs(0)
        pid = gl.program_id(0)
        if j % 2 == 1:
            pid = programs - 1 - pid
        return j * programs + pid

    @gluon.jit
    def _tile(j, tiling, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, REVERSE_M: gl.constexpr,
              DENSE: gl.constexpr, CONSUMERS: gl.constexpr):
        """The program's tile in round j (``_tile_of_round``) of NUM_TILES = NUM_M query tiles
        x (sequences x heads), query-tile-major: tile t is query tile t // (sequences x heads)
        of (sequence, head) t % (sequences x heads), the longest causal tiles first
        (REVERSE_M). Query tiles are counted back from the sequence's last row, so tile m's
        first row m0 = q_len - (NUM_M - m) x tile rows may be negative (rows before 0 are
        none of the sequence's). A t past the last tile (a short last round) has no rows
        and no blocks.
        Returns the tile's head, key head, first row, bounds, key block count and its k/v
        planes."""
        (NUM_M, NUM_TILES, H, G, LQ, LK, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, KB, KH, VB, VH) = tiling
        t = _tile_of_round(j)
        valid = t < NUM_TILES
        t = gl.minimum(t, NUM_TILES - 1)
        bh_count = NUM_TILES // NUM_M
        pid_m = t // bh_count
        bh = t % bh_count
        if REVERSE_M:
            pid_m = NUM_M - 1 - pid_m
        b = bh // H
        h = bh % H
        kvh = h // G
        q_start, q_len, k_start, k_len = _bounds(b, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, LK, DENSE)
        q_len = gl.where(valid, q_len, 0)  # then every row is before the tile's first: no rows, no blocks
        # Tiles end at the sequence's last row: a partial tile holds its first rows, whose
        # causal blocks are the fewest (a partial last tile would leave consumers idle
        # through the longest walk).
        m0 = q_len - (NUM_M - pid_m) * (CONSUMERS * _WG_ROWS)
        if CAUSAL:
            n_end = gl.minimum(k_len, k_len - q_len + gl.minimum(m0 + CONSUMERS * _WG_ROWS, q_len))
        else:
            n_end = k_len
        n_blocks = gl.where(m0 + CONSUMERS * _WG_ROWS > 0, gl.cdiv(gl.maximum(n_end, 0), BLOCK_N), 0)
        return h, kvh, m0, q_start, q_len, k_start, k_len, n_blocks, b * KB + kvh * KH, b * VB + kvh * VH

    @gluon.jit
    def _consumer(args, WG: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                  S_SPLIT: gl.constexpr, STAGES: gl.constexpr, REVERSE_M: gl.constexpr, DENSE: gl.constexpr,
                  CONSUMERS: gl.constexpr):
        """Rows m0 + WG * 64 .. + 63 of each of the program's tiles: their blocks, the merge,
        the output and LSE stores."""
        (q_desc, k_desc, v_desc, o_desc, o_ptr, v_ptr, lse_ptr, q_smem, k_smem, v_smem, v_fix_smem, o_smem, q_bar,
         k_ready, v_ready, kv_empty, tiling, KV_S, qk_scale, stride_ot, stride_vp, stride_vt, stride_lh, KC, VC) = args
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_D, 16])
        R_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        PR_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=R_LAYOUT, k_width=2)
        ONES_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=R_LAYOUT, k_width=2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        SPLIT_BLOCKS: gl.constexpr = S_SPLIT // BLOCK_N

        qs = q_smem.index(WG)
        os_ = o_smem.index(WG)
        c0 = 0  # the program's key blocks so far: block c sits in stage c % STAGES
        q_loads = 0
        for j in range(0, gl.cdiv(tiling[1], gl.num_programs(0))):
            h, kvh, m0, q_start, q_len, k_start, k_len, n_blocks, KP, VP = _tile(j, tiling, CAUSAL, BLOCK_N,
                                                                                 REVERSE_M, DENSE, CONSUMERS)
            q0 = m0 + WG * _WG_ROWS
            has_rows = (q0 < q_len) & (q0 + _WG_ROWS > 0)
            if CAUSAL:
                my_end = gl.minimum(k_len, k_len - q_len + gl.minimum(q0 + _WG_ROWS, q_len))
                my_full = gl.minimum(k_len, k_len - q_len + q0 + 1)
            else:
                my_end = k_len
                my_full = k_len
            my_full = gl.maximum(my_full, 0) // BLOCK_N
            my_blocks = gl.where(has_rows, gl.cdiv(gl.maximum(my_end, 0), BLOCK_N), 0)

            m = gl.full([_WG_ROWS], float("-inf"), gl.float32, ROW_S)
            l = gl.zeros([_WG_ROWS], gl.float32, ROW_S)
            acc = gl.zeros([_WG_ROWS, BLOCK_D], gl.float32, O_LAYOUT)
            if my_blocks > 0:
                mbarrier.expect(q_bar.index(WG), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [(q_start + q0).to(gl.int32), h * BLOCK_D], q_bar.index(WG),
                                                qs)
                mbarrier.wait(q_bar.index(WG), q_loads & 1)
                q_loads += 1
                ones = gl.full([BLOCK_N, _ROWSUM_COLS], 1.0, k_desc.dtype, ONES_LAYOUT)
                s_zero = gl.zeros([_WG_ROWS, BLOCK_N], gl.float32, S_LAYOUT)
                m_s = gl.full([_WG_ROWS], float("-inf"), gl.float32, ROW_S)
                l_s = gl.zeros([_WG_ROWS], gl.float32, ROW_S)
                acc_s = gl.zeros([_WG_ROWS, BLOCK_D], gl.float32, O_LAYOUT)
                # Block 0 (a split's first): its softmax; its P@V goes out with block 1's QK^T.
                st0 = c0 % STAGES
                mbarrier.wait(k_ready.index(st0), (c0 // STAGES) & 1)
                s = warpgroup_mma(qs, k_smem.index(st0).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
                s = warpgroup_mma_wait(0, deps=(s, ))
                if my_full == 0:
                    s = _mask(s, 0, q0, q_len, k_len, CAUSAL, BLOCK_N, ROW_S, COL_S)
                p, alpha, m_s, l_s = _softmax(s, m_s, l_s, qk_scale, ones, R_LAYOUT, PR_LAYOUT, ROW_S)
                # The blocks every row sees in full, then the masked ones (the Triton kernel's
                # two loops): the unmasked blocks skip the select, which changes no bits.
                n_unmasked = gl.minimum(gl.maximum(my_full, 1), my_blocks)
                for i in range(1, n_unmasked):
                    m, l, acc, m_s, l_s, acc_s, p, alpha = _block(
                        i, c0, qs, k_smem, v_smem, k_ready, v_ready, kv_empty, m, l, acc, m_s, l_s, acc_s, p, alpha,
                        s_zero, ones, qk_scale, q0, q_len, k_len, False, CAUSAL, BLOCK_N, BLOCK_D, STAGES,
                        SPLIT_BLOCKS, O_LAYOUT, R_LAYOUT, P_LAYOUT, PR_LAYOUT, ROW_S, COL_S, ROW_O)
                for i in range(n_unmasked, my_blocks):
                    m, l, acc, m_s, l_s, acc_s, p, alpha = _block(
                        i, c0, qs, k_smem, v_smem, k_ready, v_ready, kv_empty, m, l, acc, m_s, l_s, acc_s, p, alpha,
                        s_zero, ones, qk_scale, q0, q_len, k_len, True, CAUSAL, BLOCK_N, BLOCK_D, STAGES,
                        SPLIT_BLOCKS, O_LAYOUT, R_LAYOUT, P_LAYOUT, PR_LAYOUT, ROW_S, COL_S, ROW_O)
                # The last block's P@V. Its values come from the stage unless its keys run past
                # the sequence inside the tensor (TMA zero-fills only past the tensor's rows).
                last = my_blocks - 1
                lc = c0 + last
                lst = lc % STAGES
                mbarrier.wait(v_ready.index(lst), (lc // STAGES) & 1)
                acc_s = acc_s * gl.convert_layout(alpha, ROW_O)[:, None]
                p_op = gl.convert_layout(p, P_LAYOUT)
                v_last = v_smem.index(lst).reshape([BLOCK_N, BLOCK_D])
                if (last + 1) * BLOCK_N > k_len and k_start + k_len < KV_S:
                    v_last = _zeroed_value_block(v_ptr + VP.to(gl.int64) * stride_vp, v_fix_smem.index(WG),
                                                 k_start + last * BLOCK_N,
                                                 k_len - last * BLOCK_N, stride_vt, kvh * VC, BLOCK_N, BLOCK_D)
                acc_s = warpgroup_mma(p_op, v_last, acc_s, is_async=True)
                acc_s, p_op = warpgroup_mma_wait(0, deps=(acc_s, p_op))
                mbarrier.arrive(kv_empty.index(lst), count=1)
                m, l, acc = _merge(m, l, acc, m_s, l_s, acc_s, ROW_O)
            # The tile's blocks past this consumer's rows (the causal diagonal of the later
            # ones): released once filled, so the stage count stays in step with the producer's.
            for i in range(my_blocks, n_blocks):
                c = c0 + i
                mbarrier.wait(k_ready.index(c % STAGES), (c // STAGES) & 1)
                mbarrier.arrive(kv_empty.index(c % STAGES), count=1)
            c0 += n_blocks
            if has_rows:
                # kernels.attention.softmax.finish; a row that saw no key gives 0 and -inf.
                seen = l > 0
                out = (acc / gl.convert_layout(gl.where(seen, l, 1.0), ROW_O)[:, None]).to(o_desc.dtype)
                lse = gl.where(seen, m + gl.log2(gl.where(seen, l, 1.0)), float("-inf"))
                rows = q0 + gl.arange(0, _WG_ROWS, layout=ROW_S)
                gl.store(lse_ptr + h.to(gl.int64) * stride_lh + q_start + rows, lse, mask=(rows >= 0) & (rows < q_len))
                if (q0 >= 0) & (q0 + _WG_ROWS <= q_len):
                    # A whole tile by TMA, once the previous tile's store has left the staging tile.
                    tma.store_wait(0)
                    os_.store(out)
                    fence_async_shared()
                    tma.async_copy_shared_to_global(o_desc, [(q_start + q0).to(gl.int32), h * BLOCK_D], os_)
                else:
                    # The sequence's first rows: the rows before them belong to another sequence.
                    _store_rows(o_ptr, out, q_start + q0, -q0, q_len - q0, stride_ot, h * BLOCK_D, O_LAYOUT)
        tma.store_wait(0)

    @gluon.jit
    def _producer(args, WG: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                  S_SPLIT: gl.constexpr, STAGES: gl.constexpr, REVERSE_M: gl.constexpr, DENSE: gl.constexpr,
                  CONSUMERS: gl.constexpr):
        """K and V blocks of every tile of the program into the stages, each once every
        consumer freed it."""
        (q_desc, k_desc, v_desc, o_desc, o_ptr, v_ptr, lse_ptr, q_smem, k_smem, v_smem, v_fix_smem, o_smem, q_bar,
         k_ready, v_ready, kv_empty, tiling, KV_S, qk_scale, stride_ot, stride_vp, stride_vt, stride_lh, KC, VC) = args
        c = 0
        for j in range(0, gl.cdiv(tiling[1], gl.num_programs(0))):
            h, kvh, m0, q_start, q_len, k_start, k_len, n_blocks, KP, VP = _tile(j, tiling, CAUSAL, BLOCK_N,
                                                                                 REVERSE_M, DENSE, CONSUMERS)
            for i in range(n_blocks):
                st = c % STAGES
                row = k_start + i * BLOCK_N
                mbarrier.wait(kv_empty.index(st), ((c // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [KP, row, kvh * KC], k_ready.index(st), k_smem.index(st))
                mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [VP, row, kvh * VC], v_ready.index(st), v_smem.index(st))
                c += 1

    # Lengths and tile counts are not specialized on: they vary per call, and Triton 3.6
    # fails to lower the kernel with a one-key sequence's lengths folded in as constants.
    @gluon.jit(do_not_specialize=["LQ", "LK", "KV_S", "NUM_M", "NUM_TILES"])
    def attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, o_ptr, v_ptr, lse_ptr,
                           q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
                           stride_ot, stride_vp, stride_vt, stride_lh, H, G, LQ, LK, KV_S, qk_scale,
                           KB, KH, KC, VB, VH, VC, NUM_M, NUM_TILES,
                           CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                           S_SPLIT: gl.constexpr, STAGES: gl.constexpr, REVERSE_M: gl.constexpr,
                           DENSE: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        """Full forward, persistent: launch one program per SM (at most NUM_TILES); tile t
        is query tile t // (NUM_TILES // NUM_M) (CONSUMERS x 64 rows) of (sequence, head)
        t % (NUM_TILES // NUM_M) (``_tile``); REVERSE_M takes the longest causal tiles first (order only).
        q/o: 2-D row views [tokens, Hq * D]; k/v: 3-D views [planes, KV_S, cols], sequence
        b's key j of head kvh at plane b * KB + kvh * KH, row k_start + j, column kvh * KC
        (``_bounds``); v_ptr, stride_vp, stride_vt: v's view as a pointer (plane and row
        strides). Launch with num_warps=4 (one consumer) and maxnreg=launch_registers(CONSUMERS)
        (168 for two consumers, 128 for three), CONSUMER_REGS=consumer_registers(CONSUMERS)
        (240, 160): the producer's warpgroup then keeps PRODUCER_REGS and the consumers take
        the rest of the register file."""
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
        o_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        v_fix_smem = gl.allocate_shared_memory(v_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(q_bar.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=CONSUMERS)
        tiling = (NUM_M, NUM_TILES, H, G, LQ, LK, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, KB, KH, VB, VH)
        args = (q_desc, k_desc, v_desc, o_desc, o_ptr, v_ptr, lse_ptr, q_smem, k_smem, v_smem, v_fix_smem, o_smem,
                q_bar, k_ready, v_ready, kv_empty, tiling, KV_S, qk_scale, stride_ot, stride_vp, stride_vt, stride_lh,
                KC, VC)
        gl.static_assert(CONSUMERS == 2 or CONSUMERS == 3, "2 or 3 consumer warpgroups")
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer, (args, 0, CAUSAL, BLOCK_N, BLOCK_D, S_SPLIT, STAGES, REVERSE_M, DENSE, CONSUMERS)),
                (_consumer, (args, 1, CAUSAL, BLOCK_N, BLOCK_D, S_SPLIT, STAGES, REVERSE_M, DENSE, CONSUMERS)),
                (_producer, (args, 2, CAUSAL, BLOCK_N, BLOCK_D, S_SPLIT, STAGES, REVERSE_M, DENSE, CONSUMERS)),
            ], [4, 1], [CONSUMER_REGS, _PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (args, 0, CAUSAL, BLOCK_N, BLOCK_D, S_SPLIT, STAGES, REVERSE_M, DENSE, CONSUMERS)),
                (_consumer, (args, 1, CAUSAL, BLOCK_N, BLOCK_D, S_SPLIT, STAGES, REVERSE_M, DENSE, CONSUMERS)),
                (_consumer, (args, 2, CAUSAL, BLOCK_N, BLOCK_D, S_SPLIT, STAGES, REVERSE_M, DENSE, CONSUMERS)),
                (_producer, (args, 3, CAUSAL, BLOCK_N, BLOCK_D, S_SPLIT, STAGES, REVERSE_M, DENSE, CONSUMERS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, _PRODUCER_REGS])
else:  # pragma: no cover
    attn_fwd_ws_kernel = None
