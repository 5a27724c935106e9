"""Attention benchmark: rlkernels' batch-invariant attention vs SDPA (FA2, cuDNN) and FlexAttention.

    python -m rlkernels.bench attention [--json PATH] [--quick] [--head-dims 128,64]
                                        [--lengths 1024,4096,16384] [--no-backward] [--no-decode]

Prefill (causal, bf16, 16 query / 8 KV heads, B * L = 16384 tokens): forward and
forward+backward TFLOP/s (causal forward FLOPs = 2 * B * Hq * L^2 * D; forward+backward
= 3.5x forward) for rlkernels, SDPA with the FLASH_ATTENTION and CUDNN_ATTENTION
backends (q/k/v as [B, H, L, D], enable_gqa=True) and compiled FlexAttention with a
causal block mask built outside the timed region. Each peer is guarded: a missing
backend is reported in its column, not fatal. Decode (one query per sequence over a
full KV cache) at (B, S) = (16, 4096), (64, 1024), (1, 32768): µs and TB/s of KV read
against the device copy bandwidth, vs cuDNN SDPA and Flex; ``rlkernels_hf_layout`` reads
the same cache in Hugging Face's [B, Hkv, S, D] layout in place. The ``bitwise`` columns
check, in the same run, that prefill rows equal decode rows (split-KV kernel) and
that a sequence's rows alone equal its rows inside the batch.

Timing: ``triton.testing.do_bench`` medians (bench.common.median_ms). rlkernels'
decode passes ``cache_seqlens`` as an int, so its call reads nothing back from the GPU.
Decode is also timed as CUDA-graph replays (``*_graph_us``) for rlkernels and cuDNN:
the GPU time of a step without the host's launch cost, as rollout engines run it.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from .common import median_ms, print_table, write_json

HQ, HKV = 16, 8
TOKENS = 16384
LENGTHS = (1024, 4096, 16384)
DECODE_SHAPES = ((16, 4096), (64, 1024), (1, 32768))
PEERS = ("sdpa_flash", "sdpa_cudnn", "flex")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head-dims", default="128,64", help="comma-separated head dims")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prefill sequence lengths")
    parser.add_argument("--no-backward", action="store_true", help="skip forward+backward timings")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode shapes")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill shapes")
    parser.add_argument("--sliding-window", type=int, default=None,
                        help="prefill with a sliding window of W keys (a query sees keys fewer than W positions "
                             "back, Mistral's and Gemma's rule) against FlexAttention's sliding-window mask "
                             "(SDPA takes no window); the decode shapes are skipped")


def _flops_fwd(b: int, l: int, d: int, window: int | None = None) -> float:
    """Causal forward FLOPs: 4 * D per (query, visible key) pair, L^2 / 2 pairs per head
    (the convention FlashAttention reports); under a window of W keys the band's area,
    (L^2 - (L - W)^2) / 2, which is the causal count at W >= L."""
    w = l if window is None else min(window, l)
    return 2.0 * b * HQ * (l * l - (l - w) ** 2) * d


def _sdpa(backend_name: str) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def fn(q, k, v, causal=True):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return fn


_FLEX: dict[str, Any] = {}


def _flex():
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        # Every (shape, head dim, decode) case is one more compiled graph of the same function:
        # past dynamo's default recompile limit (8) Flex would silently run unfused.
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _causal_block_mask(l: int, window: int | None = None):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return create_block_mask(causal if window is None else sliding, B=None, H=None, Q_LEN=l, KV_LEN=l, device="cuda")


def _peer_fn(name: str, qh, kh, vh, causal: bool, l_q: int, window: int | None = None) -> Callable[[], torch.Tensor]:
    """A zero-argument call of peer ``name`` on [B, H, L, D] tensors (mask built here, untimed);
    ``window``: Flex's sliding-window mask (the SDPA peers take none)."""
    if name == "sdpa_flash":
        f = _sdpa("FLASH_ATTENTION")
        return lambda: f(qh, kh, vh, causal)
    if name == "sdpa_cudnn":
        f = _sdpa("CUDNN_ATTENTION")
        return lambda: f(qh, kh, vh, causal)
    if name == "flex":
        flex = _flex()
        mask = _causal_block_mask(l_q, window) if causal else None
        return lambda: flex(qh, kh, vh, block_mask=mask, enable_gqa=True)
    raise KeyError(name)


def _time(fn: Callable[[], Any]) -> tuple[float | None, str | None]:
    try:
        return median_ms(fn), None
    except Exception as exc:  # noqa: BLE001 - a missing peer backend is a result, not a crash
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"


def _graph_replay(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn captured once in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _fwd_bwd(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], grad: torch.Tensor) -> Callable[[], Any]:
    def run():
        for t in leaves:
            t.grad = None
        fn().backward(grad)
    return run


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def prefill_vs_decode_bitwise(q, k, v, positions: list[int], window: int | None = None) -> bool:
    """Rows of sequence 0's full causal forward == decode steps at ``positions`` over a
    cache with NaN past the step (split-KV kernel) == the sequence alone; ``window``: a
    sliding window of that many keys throughout."""
    from ..ops.attention import flash_attn_func, flash_attn_with_kvcache

    win = dict(window_size=(window - 1, 0)) if window else {}
    full = flash_attn_func(q, k, v, **win)
    ok = _bits_equal(flash_attn_func(q[:1], k[:1], v[:1], **win)[0], full[0])
    l = q.shape[1]
    kc = torch.full((1, l, k.shape[2], k.shape[3]), float("nan"), dtype=k.dtype, device=k.device)
    vc = kc.clone()
    for p in positions:
        kc[:, :p], vc[:, :p] = k[:1, :p], v[:1, :p]
        kc[:, p:], vc[:, p:] = float("nan"), float("nan")
        row = flash_attn_with_kvcache(q[:1, p:p + 1], kc, vc, k[:1, p:p + 1], v[:1, p:p + 1], p, **win)
        ok = ok and _bits_equal(row[0, 0], full[0, p])
    return ok


def _prefill_rows(d: int, lengths: tuple[int, ...], backward: bool, window: int | None = None
                  ) -> list[dict[str, Any]]:
    from ..ops.attention import flash_attn_func

    win = dict(window_size=(window - 1, 0)) if window else {}
    peers = ("flex",) if window else PEERS

    rows = []
    for l in lengths:
        b = max(1, TOKENS // l)
        g = torch.Generator(device="cuda").manual_seed(l + d)
        q = torch.randn(b, l, HQ, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(b, l, HKV, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(b, l, HKV, d, device="cuda", generator=g, dtype=torch.bfloat16)
        do = torch.randn(b, l, HQ, d, device="cuda", generator=g, dtype=torch.bfloat16)
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        doh = do.transpose(1, 2).contiguous()
        flops = _flops_fwd(b, l, d, window)
        row: dict[str, Any] = {"D": d, "L": l, "B": b, "window": window}
        fns: dict[str, Callable[[], torch.Tensor]] = {"rlkernels": lambda: flash_attn_func(q, k, v, **win)}
        errors: dict[str, str] = {}
        for name in peers:
            try:
                fns[name] = _peer_fn(name, qh, kh, vh, True, l, window)
            except Exception as exc:  # noqa: BLE001
                errors[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
        for name, fn in fns.items():
            with torch.no_grad():
                ms, err = _time(fn)
            row[f"{name}_fwd_tflops"] = flops / (ms * 1e-3) / 1e12 if ms else None
            if err:
                errors[name] = err
            if backward:
                if name == "rlkernels":
                    leaves = [t.requires_grad_() for t in (q, k, v)]
                    bfn = _fwd_bwd(lambda: flash_attn_func(q, k, v, **win), leaves, do)
                else:
                    leaves = [t.requires_grad_() for t in (qh, kh, vh)]
                    peer = _peer_fn(name, qh, kh, vh, True, l, window) if name not in errors else None
                    bfn = _fwd_bwd(peer, leaves, doh) if peer else None
                ms_b, err_b = _time(bfn) if bfn else (None, errors.get(name))
                row[f"{name}_fwdbwd_tflops"] = 3.5 * flops / (ms_b * 1e-3) / 1e12 if ms_b else None
                if err_b and name not in errors:
                    errors[name] = err_b
                for t in leaves:
                    t.requires_grad_(False)
                    t.grad = None
        for name in peers:
            ours, theirs = row.get("rlkernels_fwd_tflops"), row.get(f"{name}_fwd_tflops")
            row[f"fwd_vs_{name}"] = ours / theirs if ours and theirs else None
            ours_b, theirs_b = row.get("rlkernels_fwdbwd_tflops"), row.get(f"{name}_fwdbwd_tflops")
            row[f"fwdbwd_vs_{name}"] = ours_b / theirs_b if ours_b and theirs_b else None
        positions = sorted({0, 1, 63, 64, l // 2 + 1, min(l - 1, 1024), l - 1})
        with torch.no_grad():
            row["bitwise_prefill_eq_decode"] = prefill_vs_decode_bitwise(q[:2], k[:2], v[:2], positions, window)
        row["errors"] = errors or None
        rows.append(row)
        print(row, flush=True)
        del q, k, v, do, qh, kh, vh, doh
        torch.cuda.empty_cache()
    return rows


def _decode_rows(d: int, shapes: tuple[tuple[int, int], ...], copy_gbs: float) -> list[dict[str, Any]]:
    from ..ops.attention import flash_attn_func, flash_attn_with_kvcache

    rows = []
    for b, s in shapes:
        g = torch.Generator(device="cuda").manual_seed(b * 7 + s)
        q = torch.randn(b, 1, HQ, d, device="cuda", generator=g, dtype=torch.bfloat16)
        kc = torch.randn(b, s, HKV, d, device="cuda", generator=g, dtype=torch.bfloat16)
        vc = torch.randn(b, s, HKV, d, device="cuda", generator=g, dtype=torch.bfloat16)
        qh, kh, vh = q.transpose(1, 2).contiguous(), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        kv_bytes = 2 * b * s * HKV * d * 2
        row: dict[str, Any] = {"D": d, "B": b, "S": s, "kv_MB": kv_bytes / 1e6}
        fns: dict[str, Callable[[], Any]] = {
            "rlkernels": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=s),
            # The cache in Hugging Face's [B, Hkv, S, D] layout (what the peers read), in place.
            "rlkernels_hf_layout": lambda: flash_attn_with_kvcache(q, kh.transpose(1, 2), vh.transpose(1, 2),
                                                                   cache_seqlens=s)}
        errors: dict[str, str] = {}
        for name in ("sdpa_cudnn", "flex"):
            try:
                fns[name] = _peer_fn(name, qh, kh, vh, False, 1)
            except Exception as exc:  # noqa: BLE001
                errors[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
        with torch.no_grad():
            for name, fn in fns.items():
                ms, err = _time(fn)
                row[f"{name}_us"] = ms * 1e3 if ms else None
                row[f"{name}_TB/s"] = kv_bytes / (ms * 1e-3) / 1e12 if ms else None
                if err:
                    errors[name] = err
            # GPU time without the host's launch cost: the same call captured in a CUDA graph
            # (how rollout engines run decode steps), replayed.
            for name in ("rlkernels", "sdpa_cudnn"):
                if name in fns and not errors.get(name):
                    ms, err = _time(_graph_replay(fns[name]))
                    row[f"{name}_graph_us"] = ms * 1e3 if ms else None
                    if err:
                        errors[f"{name}_graph"] = err
            # The decode rows (split-KV kernel) == the full kernel's rows for Lq = 1 over the cache.
            row["bitwise_decode_eq_full"] = (_bits_equal(fns["rlkernels"](), flash_attn_func(q, kc, vc))
                                             and _bits_equal(fns["rlkernels_hf_layout"](), fns["rlkernels"]()))
        for name in ("sdpa_cudnn", "flex"):
            ours, theirs = row.get("rlkernels_us"), row.get(f"{name}_us")
            row[f"time_vs_{name}"] = ours / theirs if ours and theirs else None
        ours, theirs = row.get("rlkernels_hf_layout_us"), row.get("sdpa_cudnn_us")
        row["hf_layout_vs_sdpa_cudnn"] = ours / theirs if ours and theirs else None
        ours, theirs = row.get("rlkernels_graph_us"), row.get("sdpa_cudnn_graph_us")
        row["graph_time_vs_sdpa_cudnn"] = ours / theirs if ours and theirs else None
        row["graph_TB/s"] = kv_bytes / (ours * 1e-6) / 1e12 if ours else None
        row["copy_%"] = 100 * row["rlkernels_TB/s"] * 1e3 / copy_gbs if row.get("rlkernels_TB/s") else None
        row["errors"] = errors or None
        rows.append(row)
        print(row, flush=True)
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from .bmm import copy_bandwidth_gbs

    head_dims = tuple(int(x) for x in getattr(args, "head_dims", "128,64").split(","))
    lengths = tuple(int(x) for x in getattr(args, "lengths", ",".join(map(str, LENGTHS))).split(","))
    if args.quick:
        head_dims, lengths = head_dims[:1], lengths[:1]
    copy_gbs = copy_bandwidth_gbs()
    window = getattr(args, "sliding_window", None)
    prefill: list[dict[str, Any]] = []
    decode: list[dict[str, Any]] = []
    for d in head_dims:
        if not getattr(args, "no_prefill", False):
            prefill += _prefill_rows(d, lengths, not getattr(args, "no_backward", False), window)
        if not getattr(args, "no_decode", False) and window is None:
            decode += _decode_rows(d, DECODE_SHAPES[:1] if args.quick else DECODE_SHAPES, copy_gbs)
    if prefill and window:
        print_table(f"attention prefill, causal bf16, 16/8 heads, sliding window {window}, TFLOP/s of the pairs "
                    "each window holds (fwd+bwd = 3.5x fwd FLOPs)", prefill,
                    ["D", "L", "B", "window", "rlkernels_fwd_tflops", "flex_fwd_tflops", "fwd_vs_flex",
                     "rlkernels_fwdbwd_tflops", "flex_fwdbwd_tflops", "fwdbwd_vs_flex", "bitwise_prefill_eq_decode"])
    elif prefill:
        print_table("attention prefill, causal bf16, 16/8 heads, TFLOP/s (fwd+bwd = 3.5x fwd FLOPs)", prefill,
                    ["D", "L", "B", "rlkernels_fwd_tflops", "sdpa_flash_fwd_tflops", "sdpa_cudnn_fwd_tflops",
                     "flex_fwd_tflops", "fwd_vs_sdpa_cudnn", "fwd_vs_flex", "rlkernels_fwdbwd_tflops",
                     "sdpa_flash_fwdbwd_tflops", "sdpa_cudnn_fwdbwd_tflops", "flex_fwdbwd_tflops",
                     "fwdbwd_vs_sdpa_cudnn", "fwdbwd_vs_flex", "bitwise_prefill_eq_decode"])
    if decode:
        print_table(f"attention decode, bf16, 16/8 heads (copy bandwidth {copy_gbs:.0f} GB/s)", decode,
                    ["D", "B", "S", "kv_MB", "rlkernels_us", "sdpa_cudnn_us", "flex_us", "time_vs_sdpa_cudnn",
                     "time_vs_flex", "rlkernels_hf_layout_us", "hf_layout_vs_sdpa_cudnn", "rlkernels_graph_us",
                     "sdpa_cudnn_graph_us", "graph_time_vs_sdpa_cudnn",
                     "rlkernels_TB/s", "graph_TB/s", "copy_%", "bitwise_decode_eq_full"])
    for r in prefill + decode:
        if r.get("errors"):
            print(f"errors at {r}: {r['errors']}", flush=True)
    rows = [dict(r, kind="prefill") for r in prefill] + [dict(r, kind="decode") for r in decode]
    write_json(args.json, "attention", rows, {"copy_bandwidth_gbs": copy_gbs})
    return rows
