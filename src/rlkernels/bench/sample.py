"""linear_sample benchmark: the fused head sampler vs the stock sampler, bf16.

    python -m rlkernels.bench sample [--json PATH] [--quick]

Stock is what a Hugging Face sampler runs: ``logits = F.linear(h, W)`` (bf16, cuBLAS),
``softmax(logits.float() / T)``, ``torch.multinomial``. rlkernels is
:func:`rlkernels.linear_sample` (which also returns the token's log-prob). Per (N, D):
eager medians (device events after warm-up), CUDA-graph replay medians for N <= 16,
where launches dominate, the ratio rlkernels / stock, and the peak memory each allocates
beyond its inputs. V = 151936 (Qwen's vocabulary); the head is scaled to a trained
model's logits (std ~6).
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from .common import graph_median_us, median_ms, peak_extra_memory_gib, print_table, write_json

VOCAB = 151936
ROWS = (1, 16, 256, 4096)
DIMS = (2048, 4096)
GRAPH_MAX_ROWS = 16
TEMPERATURE = 0.8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size V")


def _case(n: int, d: int, vocab: int) -> dict[str, Any]:
    from .. import linear_sample

    g = torch.Generator(device="cuda").manual_seed(n * 7 + d)
    h = torch.randn(n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(vocab, d, device="cuda", generator=g) * (6.0 / d ** 0.5)).to(torch.bfloat16)
    streams = torch.arange(n, device="cuda")
    positions = torch.full((n,), 17, device="cuda", dtype=torch.int64)

    def stock():
        probs = torch.softmax(F.linear(h, w).float() / TEMPERATURE, dim=-1)
        return torch.multinomial(probs, 1)

    def ours():
        return linear_sample(h, w, temperature=TEMPERATURE, seed=5, streams=streams, positions=positions)

    row: dict[str, Any] = {"N": n, "D": d, "V": vocab}
    row["stock_ms"] = median_ms(stock)
    row["rlkernels_ms"] = median_ms(ours)
    row["ratio"] = row["rlkernels_ms"] / row["stock_ms"]
    if n <= GRAPH_MAX_ROWS:
        row["stock_graph_us"] = graph_median_us(stock, replays=20)
        row["rlkernels_graph_us"] = graph_median_us(ours, replays=20)
        row["graph_ratio"] = row["rlkernels_graph_us"] / row["stock_graph_us"]
    row["stock_extra_gib"] = peak_extra_memory_gib(stock)
    row["rlkernels_extra_gib"] = peak_extra_memory_gib(ours)
    return row


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows_of = ROWS[:2] + ROWS[-1:] if args.quick else ROWS
    dims = DIMS[:1] if args.quick else DIMS
    rows = [_case(n, d, args.vocab) for d in dims for n in rows_of]
    print_table("linear_sample vs stock sampler (bf16 logits GEMM + fp32 softmax + multinomial)", rows,
                ["N", "D", "stock_ms", "rlkernels_ms", "ratio", "stock_graph_us", "rlkernels_graph_us",
                 "graph_ratio", "stock_extra_gib", "rlkernels_extra_gib"])
    write_json(args.json, "sample", rows)
    return rows
