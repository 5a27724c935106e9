"""linear_sample benchmark: the fused head sampler vs the stock sampler, bf16.

    python -m rlkernels.bench sample [--json PATH] [--quick]

Stock is what a Hugging Face sampler runs: ``logits = F.linear(h, W)`` (bf16, cuBLAS),
``softmax(logits.float() / T)``, ``torch.multinomial``. rlkernels is
:func:`rlkernels.linear_sample` (which also returns the token's log-prob). Per (N, D):
eager medians (device events after warm-up), CUDA-graph replay medians for N <= 16,
where launches dominate, the ratio rlkernels / stock, and the peak memory each allocates
beyond its inputs. V = 151936 (Qwen's vocabulary); the head is scaled to a trained
model's logits (std ~6).

The truncated rows draw with ``top_p`` (and ``top_k``) against stock's truncated sampler
as Hugging Face's warpers write it (top-k mask, then sort, softmax, cumsum and a scatter
of the mask, softmax, ``multinomial``), beside the untruncated ``linear_sample`` of the
same call; the trainer's rows time ``linear_logprob`` with and without the sampler's
``logit_threshold`` (forward and forward + backward).
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
TRUNCATIONS = ({"top_p": 0.95}, {"top_k": 50, "top_p": 0.95})
TRUNCATED_ROWS = (1, 16, 256)
TRAINER_ROWS = 4096


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


def _stock_truncated(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Hugging Face's TopK then TopP warpers on fp32 scores, then softmax and multinomial."""
    scores = logits.float() / TEMPERATURE
    if top_k:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[:, -1:] = False
        scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))
    return torch.multinomial(torch.softmax(scores, dim=-1), 1)


def _truncated_case(n: int, d: int, vocab: int, truncation: dict[str, float]) -> dict[str, Any]:
    from .. import linear_sample

    g = torch.Generator(device="cuda").manual_seed(n * 7 + d)
    h = torch.randn(n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(vocab, d, device="cuda", generator=g) * (6.0 / d ** 0.5)).to(torch.bfloat16)
    streams = torch.arange(n, device="cuda")
    positions = torch.full((n,), 17, device="cuda", dtype=torch.int64)
    top_k, top_p = int(truncation.get("top_k", 0)), float(truncation.get("top_p", 1.0))

    def stock():
        return _stock_truncated(F.linear(h, w), top_k, top_p)

    def plain():
        return linear_sample(h, w, temperature=TEMPERATURE, seed=5, streams=streams, positions=positions)

    def ours():
        return linear_sample(h, w, temperature=TEMPERATURE, seed=5, streams=streams, positions=positions,
                             top_k=top_k, top_p=top_p, return_threshold=True)

    tau = ours()[2]
    kept = (F.linear(h, w).float() / TEMPERATURE >= tau[:, None]).sum(dim=1).float()
    row: dict[str, Any] = {"N": n, "D": d, "V": vocab, "top_k": top_k, "top_p": top_p,
                           "kept_median": float(kept.median())}
    row["stock_ms"] = median_ms(stock)
    row["plain_ms"] = median_ms(plain)
    row["rlkernels_ms"] = median_ms(ours)
    row["ratio_vs_stock"] = row["rlkernels_ms"] / row["stock_ms"]
    row["ratio_vs_plain"] = row["rlkernels_ms"] / row["plain_ms"]
    if n <= GRAPH_MAX_ROWS:
        row["plain_graph_us"] = graph_median_us(plain, replays=20)
        row["rlkernels_graph_us"] = graph_median_us(ours, replays=20)
        row["graph_ratio_vs_plain"] = row["rlkernels_graph_us"] / row["plain_graph_us"]
    return row


def _trainer_case(n: int, d: int, vocab: int) -> dict[str, Any]:
    from .. import linear_logprob, linear_sample

    g = torch.Generator(device="cuda").manual_seed(n + d)
    h = torch.randn(n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(vocab, d, device="cuda", generator=g) * (6.0 / d ** 0.5)).to(torch.bfloat16)
    tok, _, tau = linear_sample(h, w, temperature=TEMPERATURE, seed=5, streams=torch.arange(n, device="cuda"),
                                top_p=0.95, return_threshold=True)
    hg = h.detach().clone().requires_grad_()
    wg = w.detach().clone().requires_grad_()
    row: dict[str, Any] = {"N": n, "D": d, "V": vocab}
    for name, kw in (("plain", {}), ("threshold", {"logit_threshold": tau})):
        row[f"{name}_fwd_ms"] = median_ms(lambda: linear_logprob(h, w, tok, temperature=TEMPERATURE, **kw))

        def fwd_bwd(kw=kw):
            hg.grad = wg.grad = None
            linear_logprob(hg, wg, tok, temperature=TEMPERATURE, **kw).sum().backward()

        row[f"{name}_fwd_bwd_ms"] = median_ms(fwd_bwd)
    row["fwd_ratio"] = row["threshold_fwd_ms"] / row["plain_fwd_ms"]
    row["fwd_bwd_ratio"] = row["threshold_fwd_bwd_ms"] / row["plain_fwd_bwd_ms"]
    return row


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows_of = ROWS[:2] + ROWS[-1:] if args.quick else ROWS
    dims = DIMS[:1] if args.quick else DIMS
    rows = [_case(n, d, args.vocab) for d in dims for n in rows_of]
    print_table("linear_sample vs stock sampler (bf16 logits GEMM + fp32 softmax + multinomial)", rows,
                ["N", "D", "stock_ms", "rlkernels_ms", "ratio", "stock_graph_us", "rlkernels_graph_us",
                 "graph_ratio", "stock_extra_gib", "rlkernels_extra_gib"])
    truncated = [_truncated_case(n, d, args.vocab, t) for d in dims for t in TRUNCATIONS
                 for n in (TRUNCATED_ROWS[:1] + TRUNCATED_ROWS[-1:] if args.quick else TRUNCATED_ROWS)]
    print_table("linear_sample with top-k / top-p vs stock's truncated sampler and untruncated linear_sample",
                truncated, ["N", "D", "top_k", "top_p", "kept_median", "stock_ms", "plain_ms", "rlkernels_ms",
                            "ratio_vs_stock", "ratio_vs_plain", "plain_graph_us", "rlkernels_graph_us",
                            "graph_ratio_vs_plain"])
    trainer = [_trainer_case(TRAINER_ROWS, d, args.vocab) for d in dims]
    print_table("linear_logprob with the sampler's logit_threshold vs without (the trainer's side)", trainer,
                ["N", "D", "plain_fwd_ms", "threshold_fwd_ms", "fwd_ratio", "plain_fwd_bwd_ms",
                 "threshold_fwd_bwd_ms", "fwd_bwd_ratio"])
    for r in truncated:
        r["kind"] = "truncated"
    for r in trainer:
        r["kind"] = "trainer"
    write_json(args.json, "sample", rows + truncated + trainer)
    return rows
