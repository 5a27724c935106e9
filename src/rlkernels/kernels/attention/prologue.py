"""What every attention program starts from: which tile of which (sequence, head) it
computes, its sequence's bounds and key range, the addresses of its rows, and the loads
and stores its rows and key blocks go through. Index and address arithmetic only.

A kernel returns at once where its tile lies past its sequence's rows, and the helpers
split at that check: ``tile_bounds`` (or ``program_tile`` and ``query_bounds``) before
it, ``query_rows``, ``group_rows`` and ``tile_offsets`` after, so nothing is computed
ahead of the check and each kernel issues its index arithmetic in the order it uses it.
"""
from __future__ import annotations

from .._triton import tl, triton

if triton is not None:

    @triton.jit
    def program_tile(HEADS, REVERSE: tl.constexpr):
        """(tile, bh, z, sequence, head) of this program: grid axis 0 counts tiles along the
        sequence (REVERSE: the last first, launch order only), axis 1 the (sequence, head)
        pairs bh of HEADS heads per sequence, axis 2 (z) what the kernel splits further."""
        pid = tl.program_id(0)
        if REVERSE:
            pid = tl.num_programs(0) - 1 - pid
        bh = tl.program_id(1)
        z = tl.program_id(2)
        return pid, bh, z, bh // HEADS, bh % HEADS

    @triton.jit
    def tile_bounds(HEADS, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD, KV_ROWS,
                    REVERSE: tl.constexpr, DENSE: tl.constexpr, KLEN_PTR: tl.constexpr):
        """(tile, bh, z, head, q_start, q_len, k_start, k_len): ``program_tile`` and its
        sequence's ``seq_bounds``. The kernel returns at once where its tile lies past the
        sequence's rows (nothing computed after that check runs for such a program)."""
        pid, bh, z, b, h = program_tile(HEADS, REVERSE)
        q_start, q_len, k_start, k_len = seq_bounds(b, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD,
                                                    KV_ROWS, DENSE, KLEN_PTR)
        return pid, bh, z, h, q_start, q_len, k_start, k_len

    @triton.jit
    def seq_bounds(b, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD, KV_ROWS,
                   DENSE: tl.constexpr, KLEN_PTR: tl.constexpr):
        """(q_start, q_len, k_start, k_len) of sequence b. DENSE: a padded batch of LQ
        queries per sequence whose keys start at its batch row's first key, k_len =
        k_len_ptr[b] + K_ADD (or K_ADD), so a decode step needs no index tensors built on
        the host; else read the tensors. k_start counts key rows (token strides) from the
        tensor's start: sequence b's batch row begins at row b * KV_ROWS (``key_rows``)."""
        q_start, q_len = query_bounds(b, q_start_ptr, q_len_ptr, LQ, DENSE)
        if DENSE:
            k_start = key_rows(b, 0, KV_ROWS)
            if KLEN_PTR:
                k_len = tl.load(k_len_ptr + b) + K_ADD
            else:
                k_len = b * 0 + K_ADD
        else:
            k_start = key_rows(b, tl.load(k_start_ptr + b), KV_ROWS)
            k_len = tl.load(k_len_ptr + b)
        return q_start, q_len, k_start, k_len

    @triton.jit
    def query_bounds(b, q_start_ptr, q_len_ptr, LQ, DENSE: tl.constexpr):
        """(q_start int64, q_len) of sequence b: ``seq_bounds``'s query half."""
        if DENSE:
            return b.to(tl.int64) * LQ, b * 0 + LQ
        else:
            return tl.load(q_start_ptr + b).to(tl.int64), tl.load(q_len_ptr + b)

    @triton.jit
    def tile_offsets(pid, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        """(rows pid * BLOCK + [0, BLOCK) of the sequence, columns [0, BLOCK_D))."""
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        return offs, tl.arange(0, BLOCK_D)

    @triton.jit
    def query_rows(h, G, pid_m, q_len, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """(KV head, rows offs_m, columns offs_d, row_ok) of query tile pid_m of head h
        (``tile_offsets``), row_ok where the row is one of the sequence's q_len."""
        kvh = h // G
        offs_m, offs_d = tile_offsets(pid_m, BLOCK_M, BLOCK_D)
        return kvh, offs_m, offs_d, offs_m < q_len

    @triton.jit
    def group_rows(pid_m, kvh, G, BLOCK_M: tl.constexpr):
        """(r, i, h) of tile pid_m of a KV head's rows r = i * G + g, which pack its G query
        heads: query i, head kvh * G + g."""
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        return r, r // G, kvh * G + r % G

    @triton.jit
    def key_rows(b, k_start, KV_ROWS):
        """Row index (in token strides, int64) of sequence b's key k_start. Keys are [NB, S,
        Hkv, D]: NB = 1 (KV_ROWS = 0) holds every sequence's keys in one packed run of rows;
        NB = B gives sequence b batch row b, whose batch stride is KV_ROWS token strides (a
        contiguous cache: S; Hugging Face's [B, Hkv, S, D] read in place: Hkv * S). The
        batch offset joins the row index early, so the key loop's addresses are row *
        stride + head offset as for packed rows (a separate batch term in the address cost
        the decode kernel 31 registers and half its occupancy at D = 128)."""
        return b.to(tl.int64) * KV_ROWS + k_start

    @triton.jit
    def key_base(ptr, k_start, kvh, stride_t, stride_h):
        """Address of key row k_start (``key_rows``) of KV head kvh."""
        return ptr + k_start * stride_t + kvh.to(tl.int64) * stride_h

    @triton.jit
    def query_base(ptr, q_start, h, stride_t, stride_h):
        """Address of query row q_start of head h (q, out, dO, dQ: [Tq, Hq, D])."""
        return ptr + q_start * stride_t + h * stride_h

    @triton.jit
    def tma_row(k_start, kvh, HEAD_ROWS):
        """The descriptor row (int32) of key row k_start (``key_rows``) of KV head kvh: a
        head's rows start HEAD_ROWS rows further down where heads are row blocks of the
        2D view (Hugging Face's [B, Hkv, S, D]); 0 where they are column blocks."""
        return (k_start + kvh.to(tl.int64) * HEAD_ROWS).to(tl.int32)

    @triton.jit
    def load_rows(base, offs_n, stride, offs_d, n_lim, D, EVEN_D: tl.constexpr, MASK_N: tl.constexpr):
        """Rows offs_n (< n_lim where MASK_N) of a [*, D] matrix, zeros elsewhere. With
        EVEN_D (D == BLOCK_D) the mask is constant along d, so loads stay 16 bytes wide."""
        ptrs = base + offs_n.to(tl.int64)[:, None] * stride + offs_d[None, :]
        if MASK_N:
            if EVEN_D:
                return tl.load(ptrs, mask=(offs_n < n_lim)[:, None], other=0.0)
            else:
                return tl.load(ptrs, mask=(offs_n < n_lim)[:, None] & (offs_d < D)[None, :], other=0.0)
        else:
            if EVEN_D:
                return tl.load(ptrs)
            else:
                return tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)

    @triton.jit
    def head_rows(ptr, start, head, stride_t, stride_h, KEYS: tl.constexpr):
        """Address of row start of a head: ``key_base`` of KV head ``head`` where KEYS, else
        ``query_base`` of query head ``head``."""
        if KEYS:
            return key_base(ptr, start, head, stride_t, stride_h)
        else:
            return query_base(ptr, start, head, stride_t, stride_h)

    @triton.jit
    def load_head_rows(a_ptr, b_ptr, start, head, stride_at, stride_ah, stride_bt, stride_bh, offs, offs_d, lim, D,
                       EVEN_D: tl.constexpr, KEYS: tl.constexpr):
        """Rows offs (< lim) of one head of two tensors, a then b (``head_rows``: k and v
        where KEYS, else two [Tq, Hq, D] tensors such as q and dO)."""
        a = load_rows(head_rows(a_ptr, start, head, stride_at, stride_ah, KEYS), offs, stride_at, offs_d, lim, D,
                      EVEN_D, True)
        b = load_rows(head_rows(b_ptr, start, head, stride_bt, stride_bh, KEYS), offs, stride_bt, offs_d, lim, D,
                      EVEN_D, True)
        return a, b

    @triton.jit
    def load_pair(a_desc, b_desc, a_row, a_col, b_row, b_col, a_base, b_base, stride_a, stride_b, r0, offs, offs_d,
                  lim, D, EVEN_D: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr):
        """Rows offs = r0 + arange(block) of two [*, D] matrices read together (K and V, or
        q and dO): where TMA, a whole block through each descriptor (its rows from a_row +
        r0, column a_col of the 2D view), else ``load_rows`` from a_base and b_base (rows <
        lim where MASK)."""
        if TMA:
            a = a_desc.load([a_row + r0, a_col])
            b = b_desc.load([b_row + r0, b_col])
        else:
            a = load_rows(a_base, offs, stride_a, offs_d, lim, D, EVEN_D, MASK)
            b = load_rows(b_base, offs, stride_b, offs_d, lim, D, EVEN_D, MASK)
        return a, b

    @triton.jit
    def store_rows(base, offs_m, stride, offs_d, m_lim, D, x, EVEN_D: tl.constexpr):
        ptrs = base + offs_m.to(tl.int64)[:, None] * stride + offs_d[None, :]
        if EVEN_D:
            tl.store(ptrs, x, mask=(offs_m < m_lim)[:, None])
        else:
            tl.store(ptrs, x, mask=(offs_m < m_lim)[:, None] & (offs_d < D)[None, :])

    @triton.jit
    def window_range(first_pos, last_pos, WINDOW, BLOCK_N: tl.constexpr):
        """(n_lo, n_win) of a tile whose rows sit at key positions first_pos .. last_pos,
        each seeing keys no more than WINDOW positions back: no row sees a key below n_lo,
        and no row's window hides a key at or past n_win (both multiples of BLOCK_N). The
        blocks below n_lo are exact no-ops for every row of the tile (``block_step``), so
        skipping them leaves the rows' chains, and their bits, as they are."""
        n_lo = tl.maximum(first_pos - WINDOW, 0) // BLOCK_N * BLOCK_N
        n_win = (tl.maximum(last_pos - WINDOW, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        return n_lo, n_win

    @triton.jit
    def key_range(k_len, q_len, first, end, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        """(n_end, n_full) of a tile whose rows are queries first .. end - 1: its keys end
        at n_end (causal: the last row's position + 1), and the key blocks below n_full (a
        multiple of BLOCK_N) are visible to every row of the tile (rows past q_len read q
        = 0 and are not stored)."""
        if CAUSAL:
            n_end = tl.minimum(k_len, k_len - q_len + end)
            n_full = tl.minimum(k_len, k_len - q_len + first + 1)
        else:
            n_end = k_len
            n_full = k_len
        return n_end, tl.maximum(n_full, 0) // BLOCK_N * BLOCK_N
