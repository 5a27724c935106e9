"""``linear_sample``: draw one token per row from the LM head's fp32 distribution, fused.

    token, logp = linear_sample(hidden, weight, bias, temperature=T, seed=s,
                                streams=stream_ids, positions=pos)

The distribution is the one :func:`~rlkernels.linear_logprob` scores: ``z = (h @ W^T + b) / T``
by the canonical ascending D-chain in fp32, never rounded to the model's dtype. Each
row's token is the Gumbel-max ``argmax_j z_j - log(E_j)`` (ties: the lowest id), where
``E_j`` is an exponential draw from a counter-based generator keyed by
``(seed, stream, position, j)`` -- what the row is, never where it sits in the batch
(:func:`exponential_noise`). So a row's token depends on its hidden state, the head,
T, the seed, its stream and its position, and on nothing else in the call; and its
``logp`` (and entropy) are bitwise ``linear_logprob(hidden, weight, token, bias, T)``:
the same tiles, the same statistics pass (``ops.lm_head.statistics``), the same combine.

``greedy=True`` takes ``argmax_j z_j`` (ties: the lowest id) with no noise.

No [N, V] buffer is built: the LM head's statistics pass streams the vocabulary, as
``linear_logprob``'s forward does, recording each tile's mass (its sampler variant,
``tile_statistics``); the draws then read one block of 256 ids per row. The outputs
carry no autograd graph: a sampler's log-probs are data.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from . import _validate as V_
from .._env import triton_interpret
from .._versions import fast_path
from ..gemm.chain import accumulator_dtype
from ..kernels._triton import cdiv
from ..kernels.sampling import sample_block_kernel, sample_in_block_kernel
from ..registry import OpImpl, backend_object, register_backends
from ..runtime.device import can_read_back
from ..runtime.launcher import DEFAULT_NUM_STAGES, cached_launcher
from .lm_head.config import NO_TRANSFORM, LogitTransform, fused_config
from .lm_head.lse import LSE_TILE
from .lm_head.statistics import TileRecord, TorchHeadStatistics, TritonHeadStatistics, keep_above, torch_logits
from .lm_head import truncation
from .lm_head.truncation import truncates, validate_truncation
from .lm_head.validate import head_backend, validate_head, validate_threshold, validate_transform
from ..runtime.opaque import opaque_to_compile

OP = "linear_sample"

SEED_LIMIT = 1 << 63
# Rows per block of a truncated draw: its [rows, V] fp32 logits are materialised.
TRUNCATED_ROWS = 256
POSITION_LIMIT = 1 << 32
# The first level draws one of the vocabulary's blocks of this many ids (the last may be
# shorter), the second a token inside it: the LSE order's tile, whose masses the forward records.
SAMPLE_BLOCK = LSE_TILE


# ---------------------------------------------------------------------------------------
# Validation (host side, before any launch).
# ---------------------------------------------------------------------------------------

def _check_counter(name: str, t: object, lead: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rlkernels.{OP}: {name} must be an int64 tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise ValueError(f"rlkernels.{OP}: {name} must be int64, got {t.dtype}")
    if tuple(t.shape) != lead:
        raise ValueError(f"rlkernels.{OP}: {name} shape {tuple(t.shape)} must equal hidden's leading shape {lead}")
    if t.device != device:
        raise ValueError(f"rlkernels.{OP}: {name} is on {t.device}, hidden on {device}")
    return t


def validate_seed(seed: object, device: torch.device) -> None:
    """Raise TypeError/ValueError naming the op unless ``seed`` is a Python int in [0, 2^63)
    or a one-element int64 tensor on ``device`` (hidden's).

    A tensor's value is checked where reading it costs no device sync (a CPU tensor). A
    device tensor is read by the kernels as the two 32-bit words of its int64, unchecked:
    a negative value keys the generator as its two's-complement bits, value + 2^64."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64:
            raise ValueError(f"rlkernels.{OP}: a seed tensor must be int64, got {seed.dtype}")
        if seed.numel() != 1:
            raise ValueError(f"rlkernels.{OP}: a seed tensor must hold one element, got shape {tuple(seed.shape)}")
        if seed.device != device:
            raise ValueError(f"rlkernels.{OP}: the seed tensor is on {seed.device}, hidden on {device}")
        if seed.device.type == "cpu" and int(seed.reshape(())) < 0:
            raise ValueError(f"rlkernels.{OP}: seed must be in [0, 2^63), got {int(seed.reshape(()))}")
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        kind = type(seed)
        name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        hint = " (pass int(seed))" if isinstance(seed, numbers.Integral) and not isinstance(seed, bool) else ""
        raise TypeError(f"rlkernels.{OP}: seed must be a Python int or a one-element int64 tensor, "
                        f"got {name}{hint}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"rlkernels.{OP}: seed must be in [0, 2^63), got {seed}")


def validate(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
             seed: object, streams: object, positions: object, greedy: bool) -> None:
    """Raise ValueError/TypeError naming the op on any bad argument, before any launch.
    The values the kernels read (positions, NaN logits) are checked after the draw, from
    each row's status (:func:`check_status`)."""
    validate_head(OP, hidden, weight, bias, temperature)
    V_.require_same_device(OP, hidden=hidden, weight=weight, bias=bias)
    lead = tuple(hidden.shape[:-1])
    if greedy:
        return
    validate_seed(seed, hidden.device)
    if streams is None:
        raise TypeError(f"rlkernels.{OP}: sampling needs streams, an int64 tensor of hidden's leading shape "
                        f"{lead} (which sequence each row is); greedy=True needs none")
    _check_counter("streams", streams, lead, hidden.device)
    if positions is not None:
        # Their values are checked from each row's status after the draw (check_status).
        _check_counter("positions", positions, lead, hidden.device)


# A row's status, written by the backends beside its token (sample_in_block_kernel's codes).
STATUS_OK, STATUS_NOT_A_DISTRIBUTION, STATUS_BAD_POSITION = 0, 1, 2


class SampleResult(NamedTuple):
    """A backend's draw: token int64 [N], logp and entropy fp32 [N] (fp64 for fp64), each
    row's status int32 [N] (STATUS_*), ``ok``, an int32 [1] that is 1 where every row's
    status is STATUS_OK (None: the host reduces ``status`` itself), and each row's
    truncation threshold [N] (None where the call does not truncate)."""

    token: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    status: torch.Tensor
    ok: torch.Tensor | None
    threshold: torch.Tensor | None = None


# The asynchronous device-side check torch.multinomial makes on CUDA (a private torch name:
# on only for the releases _versions.FAST_PATHS names; else the status is read back).
ASYNC_ASSERT = getattr(torch, "_assert_async", None) if fast_path("torch_assert_async")[0] else None

REFUSED_ON_DEVICE = (f"rlkernels.{OP}: a row's logits are not a distribution (NaN or all -inf), or its position "
                     f"lies outside [0, 2^32)")


def check_status(result: SampleResult, positions: torch.Tensor | None) -> None:
    """Refuse the call where any row's status is not STATUS_OK.

    On a CUDA device the check is asynchronous, as ``torch.multinomial``'s is there: a
    device-side assert with :data:`REFUSED_ON_DEVICE`, which the next synchronizing call
    raises (and which a captured CUDA graph repeats at each replay); no host sync, so the
    host keeps running ahead of the GPU. Elsewhere the status is read back and the first
    bad row is named in a ValueError (skipped under a torch.compile trace)."""
    status = result.status
    if not status.numel():
        return
    if status.is_cuda and ASYNC_ASSERT is not None:
        ok = result.ok if result.ok is not None else (status == STATUS_OK).all()
        ASYNC_ASSERT(ok, REFUSED_ON_DEVICE)
        return
    if not can_read_back(status) or not bool(status.any()):
        return
    row = int(status.nonzero()[0, 0])
    if int(status[row]) == STATUS_BAD_POSITION:
        raise ValueError(f"rlkernels.{OP}: positions must lie in [0, 2^32), got {int(positions.reshape(-1)[row])} "
                         f"at flat row {row}")
    # torch.multinomial refuses such a row too: there is no distribution to draw from.
    raise ValueError(f"rlkernels.{OP}: row {row}'s logits are not a distribution (NaN or all -inf)")


# ---------------------------------------------------------------------------------------
# The noise, defined once (the Triton kernel computes the same in kernels.sampling).
# ---------------------------------------------------------------------------------------

_U32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for a uint32 constant and uint32 values in int64."""
    lo_part = b & 0xFFFF
    hi_part = b >> 16
    lo = a * lo_part            # < 2^48
    hi = a * hi_part            # < 2^48
    return (hi + (lo >> 16)) >> 16, (((hi & 0xFFFF) << 16) + lo) & _U32


def philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
               k0: int | torch.Tensor, k1: int | torch.Tensor,
               rounds: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 (Salmon et al., 2011) on uint32 words held in int64 tensors; Triton's rounds.
    The key words are Python ints or 0-dim int64 tensors (uint32 values either way)."""
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _U32, (k1 + _KEY_B) & _U32
    return c0, c1, c2, c3


def seed_words(seed: int | torch.Tensor) -> tuple[int, int] | tuple[torch.Tensor, torch.Tensor]:
    """The Philox key (seed mod 2^32, seed >> 32): Python ints for an int seed, 0-dim int64
    tensors for a seed tensor (its int64's two 32-bit words, computed on its device: no sync)."""
    if isinstance(seed, torch.Tensor):
        value = seed.reshape(())
        return value & _U32, (value >> 32) & _U32
    return seed & _U32, (seed >> 32) & _U32


def noise_words(seed: int | torch.Tensor, streams: torch.Tensor, positions: torch.Tensor, v0: int,
                v1: int) -> torch.Tensor:
    """The generator's uint32 word x (in int64) for rows [R] and vocabulary ids [v0, v1): [R, v1 - v0]."""
    q0, q1 = v0 // 4, cdiv(v1, 4)
    dev = streams.device
    quad = torch.arange(q0, q1, dtype=torch.int64, device=dev)[None, :]
    shape = (streams.shape[0], q1 - q0)
    words = philox4x32(quad.expand(shape), (positions & _U32)[:, None].expand(shape),
                       (streams & _U32)[:, None].expand(shape), ((streams >> 32) & _U32)[:, None].expand(shape),
                       *seed_words(seed))
    # Word k of counter q belongs to id 4q + k.
    x = torch.stack(words, dim=-1).reshape(shape[0], 4 * (q1 - q0))
    return x[:, v0 - 4 * q0:v1 - 4 * q0]


def gumbel_from_words(x: torch.Tensor) -> torch.Tensor:
    """-log(E) in fp32 for the exponential E of u = (x + 1/2) 2^-32, x uint32 words in int64."""
    upper = (x >> 31) == 1
    y = torch.where(upper, x ^ _U32, x)
    w = (y >> 8).to(torch.float32) * 5.9604644775390625e-08 + ((y & 255).to(torch.float32) + 0.5) * 2.3283064365386963e-10
    t = 1.0 - w
    log1p_neg = torch.where(t == 1.0, -w, torch.log(t) * (-w) / (t - 1.0))
    e = torch.where(upper, -log1p_neg, -torch.log(w))
    return -torch.log(e)


# ---------------------------------------------------------------------------------------
# Backends. Each returns a SampleResult: (token [N] int64, logp, entropy) with
# linear_logprob's bits, and each row's status.
# ---------------------------------------------------------------------------------------

def tile_uniform(seed: int | torch.Tensor, streams: torch.Tensor, positions: torch.Tensor,
                 counter: int = _U32) -> torch.Tensor:
    """The first level's uniform in (0, 1) per row, fp64 with 53 bits (Philox counter
    (``counter``, position, stream mod 2^32, stream >> 32), words 0 and 1). The draw reads
    counter 2^32 - 1 (and the noise words counters below V / 4); a caller's own uniform
    takes another counter, independent of them."""
    shape = streams.shape
    r0, r1, _, _ = philox4x32(torch.full(shape, counter, dtype=torch.int64, device=streams.device), positions & _U32,
                              streams & _U32, (streams >> 32) & _U32, *seed_words(seed))
    return ((r0 >> 5).double() * 67108864.0 + (r1 >> 6).double() + 0.5) * 1.1102230246251565e-16


def pick_blocks(tile_m: torch.Tensor, tile_s: torch.Tensor, lse: torch.Tensor, u: torch.Tensor | None,
                vocab: int, tile_v: int) -> torch.Tensor:
    """Each row's sample block [N] from its tiles' running max and mass [N, n_tiles]: the
    first block whose running fp64 sum of mass exceeds ``u`` times the total, or (``u``
    None, greedy) the first block holding a tile whose running max is the row's max."""
    N, n_tiles = tile_m.shape
    per_block = SAMPLE_BLOCK // tile_v
    n_blocks = cdiv(vocab, SAMPLE_BLOCK)
    valid = (torch.arange(n_tiles, device=tile_m.device) * tile_v < vocab)[None, :]
    tm = torch.where(valid, tile_m, torch.full_like(tile_m, -math.inf))
    ts = torch.where(valid, tile_s, torch.zeros_like(tile_s))
    pad = n_blocks * per_block - n_tiles
    if pad > 0:
        tm = torch.cat([tm, torch.full((N, pad), -math.inf, dtype=tm.dtype, device=tm.device)], dim=1)
        ts = torch.cat([ts, torch.zeros(N, pad, dtype=ts.dtype, device=ts.device)], dim=1)
    tm, ts = tm[:, :n_blocks * per_block], ts[:, :n_blocks * per_block]
    if u is None:
        top = tm.reshape(N, n_blocks, per_block).amax(dim=2)
        return (top == top.amax(dim=1, keepdim=True)).int().argmax(dim=1)  # the first maximal block
    tile_mass = torch.where(ts > 0, ts.double() * torch.exp(tm.double() - lse.double()[:, None]),
                            torch.zeros_like(ts, dtype=torch.float64))
    mass = tile_mass.reshape(N, n_blocks, per_block).sum(dim=2)
    cum = torch.cumsum(mass, dim=1)
    hit = cum > (u * cum[:, -1])[:, None]
    last = torch.where(mass > 0, torch.arange(n_blocks, device=mass.device)[None, :], -1).amax(dim=1).clamp(min=0)
    return torch.where(hit.any(dim=1), hit.int().argmax(dim=1), last)


class TorchLinearSampleBackend:
    """The head's torch statistics pass with each tile's mass, then the two draws.

    A backend's ``sample`` draws from the kept set of ``threshold`` [N] where it is given
    (the call's ``logit_threshold``), else of (``top_k``, ``top_p``) where they truncate."""

    name = "torch"

    def sample(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
               seed: int | torch.Tensor, streams: torch.Tensor | None, positions: torch.Tensor | None,
               greedy: bool, entropy: bool = True, top_k: int = 0, top_p: float = 1.0,
               transform: LogitTransform = NO_TRANSFORM, threshold: torch.Tensor | None = None) -> SampleResult:
        stats_backend = TorchHeadStatistics()
        N, vocab = h2.shape[0], weight.shape[0]
        if threshold is None and truncates(top_k, top_p, vocab):
            threshold = truncation.threshold(stats_backend.head_scores(h2, weight, bias, temperature, transform),
                                             top_k, top_p)
        checked_positions = positions
        if not greedy and positions is None:
            positions = torch.zeros_like(streams)
        dev, adt = h2.device, accumulator_dtype(h2.dtype)
        n_tiles = stats_backend.n_tiles(vocab, h2.dtype)
        tiles = TileRecord(torch.empty(N, n_tiles, dtype=adt, device=dev),
                           torch.empty(N, n_tiles, dtype=adt, device=dev))
        m, s, u, _ = stats_backend.tile_statistics(h2, weight, bias, temperature, tiles, entropy=entropy,
                                                   threshold=threshold, transform=transform)
        no_target = torch.full((N,), -1, dtype=torch.int64, device=dev)
        _, _, lse = stats_backend.finish(m, s, u, torch.zeros_like(m), no_target, entropy=False)
        blocks = pick_blocks(*tiles, lse, None if greedy else tile_uniform(seed, streams, positions), vocab,
                             stats_backend.tile_v(h2.dtype))
        token = torch.zeros(N, dtype=torch.int64, device=dev)
        zt = torch.zeros(N, dtype=adt, device=dev)
        for b in torch.unique(blocks).tolist():
            rows = (blocks == b).nonzero()[:, 0]
            v0, v1 = b * SAMPLE_BLOCK, min(vocab, (b + 1) * SAMPLE_BLOCK)
            z = keep_above(torch_logits(h2[rows], weight, bias, v0, v1, temperature, transform),
                           None if threshold is None else threshold[rows])
            key = z
            if not greedy:
                key = z + gumbel_from_words(noise_words(seed, streams[rows], positions[rows], v0, v1)).to(adt)
            key = torch.where(torch.isnan(key), torch.full_like(key, -math.inf), key)
            at = key.argmax(dim=1)  # the first maximal index: the lowest id
            token[rows] = at + v0
            zt[rows] = z.gather(1, at[:, None])[:, 0]
        logp, ent, _ = stats_backend.finish(m, s, u, zt, token, entropy)
        status = torch.where(torch.isnan(logp), STATUS_NOT_A_DISTRIBUTION, STATUS_OK).to(torch.int32)
        if checked_positions is not None and not greedy:
            bad = (positions < 0) | (positions >= POSITION_LIMIT)
            status = torch.where(bad & (status == STATUS_OK), STATUS_BAD_POSITION, status).to(torch.int32)
        return SampleResult(token, logp, ent, status, None, threshold)


_launch_block = cached_launcher(sample_block_kernel) if sample_block_kernel is not None else None
_launch_in_block = cached_launcher(sample_in_block_kernel) if sample_in_block_kernel is not None else None

# Blocks per step of the first level's scan; lanes of the second level's dot (its smallest M;
# one under the interpreter, whose numpy dot rounds a row by its place in the tile, as the
# interpreter's fused config has one-row tiles).
SCAN_BLOCKS = 512
IN_BLOCK_LANES = 1 if triton_interpret() else 16


def _signed32(word: int) -> int:
    """A uint32 as the int32 of the same bits: the kernel's scalar stays 32-bit for every seed."""
    return word - (1 << 32) if word >= (1 << 31) else word


def _aligned(n: int) -> int:
    """n rounded up to 4 elements: 16-byte aligned pieces of a 4-byte workspace (Triton
    specializes on pointer alignment)."""
    return (n + 3) & ~3


class TritonLinearSampleBackend:
    """The head's statistics kernel with each tile's mass recorded, then the two draws;
    the second also finishes the token's log-prob as the statistics pass's combine does.

    Three launches (four at N <= the fused config's ``small_n``, whose logits come from the
    GEMM) and four allocations: an eager decode step's sampler is host-bound, so every
    host-side op counts."""

    name = "triton"

    def sample(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
               seed: int | torch.Tensor, streams: torch.Tensor | None, positions: torch.Tensor | None,
               greedy: bool, entropy: bool = True, top_k: int = 0, top_p: float = 1.0,
               transform: LogitTransform = NO_TRANSFORM, threshold: torch.Tensor | None = None) -> SampleResult:
        stats_backend = TritonHeadStatistics()
        N, D = h2.shape
        vocab = weight.shape[0]
        dev = h2.device
        cfg = fused_config(h2.dtype)
        token = torch.empty(N, dtype=torch.int64, device=dev)
        logp, ent = torch.empty(2 * N, dtype=torch.float32, device=dev).split([N, N])
        # int32: the call's all-rows-fine flag (padded to 16 bytes), each row's sample block and status.
        ok, _, blocks, status = torch.empty(4 + 2 * N, dtype=torch.int32, device=dev).split([1, 3, N, N])
        if N == 0:
            return SampleResult(token, logp, ent, status, None,
                                logp.clone() if truncates(top_k, top_p, vocab) else threshold)
        n_tiles = stats_backend.n_tiles(vocab, h2.dtype)
        n_split = cdiv(vocab, cfg.split_v)
        finds_threshold = threshold is None and truncates(top_k, top_p, vocab)
        # fp32 workspace: the forward's per-split (m, s, u) [n_split, N], each tile's
        # running max and mass [N, n_tiles], flat (the kernels index them), and where the
        # call finds a threshold each tile's largest score [N, ceil(V / LSE_TILE)].
        parts, tiles = _aligned(n_split * N), _aligned(N * n_tiles)
        maxima = N * cdiv(vocab, LSE_TILE) if finds_threshold else 0
        m, s, u, tile_m, tile_s, tile_max = torch.empty(3 * parts + 2 * tiles + maxima, dtype=torch.float32,
                                                        device=dev).split([parts, parts, parts, tiles, tiles, maxima])
        raw = None
        if finds_threshold:
            # The [N, V] fp32 logits once, by the GEMM (the fused tiles' chain): the
            # threshold is found over them, the statistics pass reads the tiles that hold
            # kept logits, and the draw its block.
            raw = stats_backend.raw_logits(h2, weight, bias)
            tile_max = tile_max.view(N, -1)
            threshold = truncation.threshold_of_logits(raw, temperature, transform, top_k, top_p, tile_max=tile_max)
        else:
            tile_max = None
        stats_backend.tile_statistics(h2, weight, bias, temperature, TileRecord(tile_m, tile_s), entropy=entropy,
                                      partials=(m, s, u), threshold=threshold, transform=transform, logits=raw,
                                      tile_max=tile_max)
        # A seed tensor is read by the kernels (a CUDA graph replays with its current value);
        # an int seed goes in as two int32 scalars of the same bits, and the pointer is unread.
        seed_in_memory = isinstance(seed, torch.Tensor)
        seed_ptr = seed if seed_in_memory else token
        seeds = (0, 0) if seed_in_memory else (_signed32(seed & 0xFFFFFFFF), _signed32(seed >> 32))
        noise = not greedy
        has_positions = noise and positions is not None
        # Unread pointers where there is no noise or no positions.
        stream_arg = streams if noise else token
        pos_arg = positions if has_positions else token
        _launch_block((N,), (tile_m, tile_s, m, s, stream_arg, pos_arg, seed_ptr, blocks, ok, N, vocab, n_tiles,
                             n_split, *seeds),
                      dict(TILE_V=cfg.block_v, SAMPLE_BLOCK=SAMPLE_BLOCK, NOISE=noise,
                           SEED_IN_MEMORY=seed_in_memory, POSITIONS=has_positions, BLOCK_B=SCAN_BLOCKS),
                      num_warps=4,
                      num_stages=DEFAULT_NUM_STAGES)
        bias = bias.contiguous() if bias is not None else None  # the kernels index it with unit stride
        score_args, score_modes = transform.launch_args(temperature, h2.device)
        _launch_in_block(
            (N,),
            (h2, weight, bias if bias is not None else h2, raw if raw is not None else logp, blocks, stream_arg,
             pos_arg, seed_ptr, m, s, u, token, logp, ent, status, ok, threshold if threshold is not None else logp,
             N, vocab, D, n_split, *score_args, *seeds,
             h2.stride(0), h2.stride(1), weight.stride(0), weight.stride(1), raw.stride(0) if raw is not None else 0),
            dict(HAS_BIAS=bias is not None, **score_modes, IEEE=h2.dtype == torch.float32,
                 EVEN_D=D % cfg.block_k == 0, NOISE=noise, SEED_IN_MEMORY=seed_in_memory,
                 POSITIONS=has_positions, ENTROPY=entropy, THRESHOLD=threshold is not None, LOGITS=raw is not None,
                 BLOCK_M=IN_BLOCK_LANES, BLOCK_V=SAMPLE_BLOCK, BLOCK_K=cfg.block_k),
            num_warps=4, num_stages=DEFAULT_NUM_STAGES,
        )
        return SampleResult(token, logp, ent, status, ok, threshold)


# ---------------------------------------------------------------------------------------
# Registry entries and the public function.
# ---------------------------------------------------------------------------------------

class _LinearSampleOp(OpImpl):
    op_class = "linear_logprob"  # its log-probs are linear_logprob's
    backend_impl: TorchLinearSampleBackend | TritonLinearSampleBackend

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                temperature: float = 1.0, seed: int | torch.Tensor | None = None,
                streams: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                return_entropy: bool = False, greedy: bool = False, top_k: int = 0, top_p: float = 1.0,
                return_threshold: bool = False, logit_threshold: torch.Tensor | None = None,
                logit_scale: float = 1.0, logit_softcap: float = 0.0):
        return _run(hidden, weight, bias, temperature, seed, streams, positions, return_entropy, greedy,
                    self.backend, self.backend_impl, top_k, top_p, return_threshold, logit_threshold, logit_scale,
                    logit_softcap)

    def forward_fp32(self, *args, **kwargs):
        return self.forward(*args, **kwargs)  # the log-probs are fp32 already

    def invariance_case(self, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
        n, d, v = (33, 40, 257) if device.type == "cpu" else (256, 1024, 32003)
        hidden = torch.randn(n, d, generator=generator).to(device=device, dtype=dtype)
        # A trained head's scale (logit std ~6), where rounding the logits would move probabilities.
        weight = (torch.randn(v, d, generator=generator) * (6.0 / d ** 0.5)).to(device=device, dtype=dtype)
        streams = torch.randint(0, 1 << 40, (n,), generator=generator).to(device)
        positions = torch.randint(0, 4096, (n,), generator=generator).to(device)

        def fn(rows: torch.Tensor):
            return self.forward(hidden[rows], weight, temperature=0.7, seed=1234, streams=streams[rows],
                                positions=positions[rows], return_entropy=True)

        # Rows are indices into (hidden, streams, positions): padding/shuffling moves them together.
        return fn, torch.arange(n, device=device)


register_backends(OP, _LinearSampleOp, {"triton": TritonLinearSampleBackend(), "torch": TorchLinearSampleBackend()})


def _run(hidden, weight, bias, temperature, seed, streams, positions, return_entropy, greedy, backend,
         sample_backend=None, top_k=0, top_p=1.0, return_threshold=False, logit_threshold=None, logit_scale=1.0,
         logit_softcap=0.0):
    V_.require_tensor(OP, "hidden", hidden)
    V_.require_tensor(OP, "weight", weight)
    if hidden.is_floating_point() and weight.is_floating_point():
        hidden, weight, bias = V_.autocast(hidden, weight, bias)
    validate(hidden, weight, bias, temperature, seed, streams, positions, greedy)
    validate_truncation(OP, top_k, top_p)
    if logit_threshold is not None:
        if truncates(top_k, top_p, weight.shape[0]):
            raise ValueError(f"rlkernels.{OP}: logit_threshold gives the kept set itself; it cannot be combined "
                             f"with top_k={top_k!r}, top_p={top_p!r} (leave them at 0 and 1.0)")
        validate_threshold(OP, logit_threshold, tuple(hidden.shape[:-1]), hidden.dtype, hidden.device)
    transform = validate_transform(OP, logit_scale, logit_softcap)
    top_k, top_p = int(top_k), float(top_p)
    name = head_backend(OP, OP, hidden, backend)
    if sample_backend is None:
        sample_backend = backend_object(OP, hidden.device, name)
    lead = hidden.shape[:-1]
    adt = accumulator_dtype(hidden.dtype)
    if hidden.is_meta:  # shapes only, as torch's ops give on meta tensors: no values to draw from
        token = torch.empty(lead, dtype=torch.int64, device=hidden.device)
        logp = hidden.new_empty(lead, dtype=adt)
        out = (token, logp, torch.empty_like(logp)) if return_entropy else (token, logp)
        return out + (torch.empty_like(logp),) if return_threshold else out
    flat = len(lead) == 1  # a [N, D] call: no reshapes (an eager decode step is host-bound)
    n = lead[0] if flat else math.prod(lead)
    h2 = hidden if flat else hidden.reshape(n, hidden.shape[-1])
    if not greedy and not flat:
        streams = streams.reshape(n)
        positions = positions.reshape(n) if positions is not None else None
    truncating = truncates(top_k, top_p, weight.shape[0])
    given = logit_threshold.detach().reshape(n).contiguous() if logit_threshold is not None else None
    with torch.no_grad():
        if truncating and n > TRUNCATED_ROWS:
            # The threshold is found over [rows, V] fp32 logits: a bounded block of rows at
            # a time (each row's draw is its own, so the blocks change no bit).
            parts = []
            for r0 in range(0, n, TRUNCATED_ROWS):
                rows = slice(r0, r0 + TRUNCATED_ROWS)
                parts.append(sample_backend.sample(
                    h2[rows], weight, bias, float(temperature), seed if not greedy else 0,
                    None if greedy else streams[rows], None if greedy or positions is None else positions[rows],
                    greedy, bool(return_entropy), top_k, top_p, transform))
            result = SampleResult(*(torch.cat(field) if field[0] is not None else None for field in zip(*parts)))
            result = result._replace(ok=None)
        else:
            result = sample_backend.sample(
                h2, weight, bias, float(temperature), seed if not greedy else 0, streams, positions, greedy,
                bool(return_entropy), top_k, top_p, transform, given)
    check_status(result, positions)
    token, logp, ent = result.token, result.logp, result.entropy
    if truncating or given is not None:
        tau = result.threshold
    else:
        tau = torch.full((n,), -math.inf, dtype=adt, device=hidden.device)
    if not flat:
        token, logp, ent, tau = token.reshape(lead), logp.reshape(lead), ent.reshape(lead), tau.reshape(lead)
    out = (token, logp, ent) if return_entropy else (token, logp)
    return out + (tau,) if return_threshold else out


@opaque_to_compile
def linear_sample(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  temperature: float = 1.0, seed: int | torch.Tensor | None = None,
                  streams: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                  return_entropy: bool = False, greedy: bool = False, top_k: int = 0, top_p: float = 1.0,
                  return_threshold: bool = False, logit_threshold: torch.Tensor | None = None,
                  logit_scale: float = 1.0, logit_softcap: float = 0.0, backend: str | None = None):
    """One token per row drawn exactly from ``softmax((hidden @ weight.T + bias) / T)`` in fp32.

    hidden: [..., D] bf16/fp16/fp32 (fp64 on the torch backend); weight: [V, D] (lm_head
    layout); bias: [V] or None. ``seed``: a Python int in [0, 2^63), or a one-element
    int64 tensor on hidden's device holding one (read by the kernels, so a CUDA graph that
    captured the call draws with the tensor's value at each replay; the same value draws
    the same bits as the int). A CPU seed tensor's value is checked; a device one is read
    as the two 32-bit words of its int64 (no host sync). ``streams``: int64 [...] (one per
    row, any value: which sequence a row is); ``positions``: int64 [...] in [0, 2^32)
    (which token of that sequence is drawn; None: 0). ``greedy=True`` takes the argmax
    instead and needs no seed or streams.

    Returns ``(token [...] int64, logp [...] fp32)`` (and ``entropy`` with
    ``return_entropy``), with no autograd graph. ``logp`` and ``entropy`` are bitwise
    ``linear_logprob(hidden, weight, token, bias, temperature=T, return_entropy=True)``.
    A row's token depends only on its hidden row, the head, T, the seed, its stream and
    its position: the same alone, in any batch, in any order. Ties go to the lowest id.
    A row whose logits hold NaN (or are all -inf), or whose position lies outside
    [0, 2^32), is refused as ``torch.multinomial`` refuses a bad row: on a CUDA device by
    an asynchronous device-side assert (no host sync; a captured graph checks at each
    replay), elsewhere by a ValueError naming the row.

    ``top_k`` (an int >= 0; 0 keeps every token) and ``top_p`` (in (0, 1]; 1 keeps every
    token) truncate the distribution in Hugging Face's order: z / T, then the k largest
    (ties at the k-th kept), then the smallest set of the largest probabilities of the
    top-k-renormalised distribution whose mass reaches p (ties at the border kept). The
    kept set is ``{v : z_v >= tau}``, tau the smallest kept scaled logit (fp32 per row; -inf
    without truncation), returned last with ``return_threshold``. The token is drawn exactly
    from the renormalised kept distribution with the same keys, and ``logp``/``entropy``
    are that distribution's: bitwise ``linear_logprob(..., logit_threshold=tau)``. Neutral
    values give the untruncated draw's bits. While truncating, the rows' fp32 logits are
    materialised, :data:`TRUNCATED_ROWS` rows at a time ([rows, V] fp32).

    ``logit_threshold`` (instead of ``top_k``/``top_p``): each row's kept set given, a tensor
    of hidden's leading shape, fp32 (fp64 for fp64 inputs), -inf keeping every logit; the
    token is drawn from ``{v : z_v >= tau}`` renormalised, with the log-probs of
    ``linear_logprob(..., logit_threshold=tau)``, and no [N, V] logits are formed. A row
    that keeps no logit is refused as a row that is not a distribution.

    ``logit_scale`` and ``logit_softcap``: the model's logits from the head's output x
    before the temperature, as :func:`rlkernels.linear_logprob` takes them (``c * tanh(x *
    s / c)``); z above is then that over T, and the log-probs stay bitwise
    ``linear_logprob``'s with the same two values.
    """
    return _run(hidden, weight, bias, temperature, seed, streams, positions, return_entropy, greedy, backend,
                top_k=top_k, top_p=top_p, return_threshold=return_threshold, logit_threshold=logit_threshold,
                logit_scale=logit_scale, logit_softcap=logit_softcap)
