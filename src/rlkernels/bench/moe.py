"""Benchmark: the invariant mixture-of-experts block against stock transformers.

    rlkernels bench moe [--device cuda|cpu] [--only layer,scoring,training,decode] [--tokens T[,T...]]
        [--layers N] [--reps R] [--json PATH] [--quick]

Shapes: Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts, top-8, expert width 768, bf16)
on CUDA; on the CPU a tiny one (hidden 64, 16 experts, top-4, width 32, fp32), a smoke run of
every code path (the CPU's numbers say nothing about a GPU's).

Sides: stock transformers with each experts implementation that runs here -- ``eager`` (a
Python loop over the experts hit, ``index_add_``), ``grouped_mm`` (transformers' default
where ``torch._grouped_mm`` runs: one grouped GEMM per projection, a sort, a gather) -- and
rlkernels (:class:`rlkernels.nn.SparseMoeBlock`: the per-expert canonical-chain GEMMs, the
fp32 combine in rank order).

Workloads:

- ``layer``: the MoE block alone on T tokens (1, 16, 256, 4096, 16384; the CPU: 1, 16, 256):
  forward (no grad) and forward + backward (gradients of the input and of every weight),
  median ms; ``bitwise``: the share of the first 8 tokens whose output in the batch equals
  their output alone.
- ``scoring`` / ``training``: a 4-layer Qwen3-30B-A3B-shaped model (random weights, SDPA
  attention for stock): log-probs of 8 x 1024 right-padded tokens, and a policy-gradient
  forward + backward on 4 x 1024 (:mod:`.model`'s workloads and bitwise fractions).
- ``decode``: ``generate`` of 16 new tokens after 16 and 64 left-padded prompts of up to 1024
  tokens, eager, and on a GPU rlkernels' ``cuda_graph=True`` too (its grouped expert
  launches read no count on the host, so the step captures); ms per new token;
  ``rlkernels_graphed_ratio``: the graphed decode over that stock variant's eager one.

Ratios are rlkernels' time over each stock variant's (below 1: faster).
"""
from __future__ import annotations

import argparse
import copy
import statistics
from typing import Any, Callable

import torch
from torch import nn

from ..integrations.hf import moe as hf_moe
from ..integrations.hf import patch_model
from . import model as whole
from .common import fixed_call_times_ms, interleaved_median_ms, only_arg, print_table, write_json

NEEDS_CUDA = False  # --device cpu runs the tiny shapes anywhere

WORKLOADS = ("layer", "scoring", "training", "decode")
STOCK_IMPLS = ("eager", "grouped_mm")
TOKENS = (1, 16, 256, 4096, 16384)
CPU_TOKENS = (1, 16, 256)
BITWISE_ROWS = 8

QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1e6,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY_MOE = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
                num_experts_per_tok=4)

# Scoring 8 x 1024, training 4 x 1024; decode prompts up to 1024 tokens, 16 new.
FULL_SIZES = whole.Sizes(8, 1024, 3, 4, 1024, 16, 512, 1024, 16, 64, 512, 1024, 16, ())
TINY_SIZES = whole.Sizes(4, 32, 3, 2, 32, 4, 4, 8, 4, 8, 4, 8, 4, ())


def _tokens_arg(value: str) -> tuple[int, ...]:
    try:
        tokens = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of token counts >= 1, got {value!r}")
    return tokens


def _only_arg(value: str) -> tuple[str, ...]:
    return only_arg(value, WORKLOADS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=whole._device_arg, default=None,
                        help="cuda (default when available; Qwen3-30B-A3B shapes) or cpu (tiny shapes, a smoke run)")
    parser.add_argument("--only", type=_only_arg, default=WORKLOADS, metavar="W[,W...]",
                        help=f"workloads to run (default: all of {','.join(WORKLOADS)})")
    parser.add_argument("--tokens", type=_tokens_arg, default=None, metavar="T[,T...]",
                        help=f"token counts of the layer workload (default {','.join(map(str, TOKENS))}; "
                             f"the CPU: {','.join(map(str, CPU_TOKENS))})")
    parser.add_argument("--layers", type=whole._positive, default=None,
                        help="decoder layers of the whole-model workloads (default 4; the CPU: 2)")
    parser.add_argument("--reps", type=whole._positive, default=None,
                        help="timed calls per point on the CPU and per model workload (default 5, 2 with --quick)")


def _config(device: torch.device, layers: int | None) -> Any:
    import transformers

    fields = dict(QWEN3_30B_A3B if device.type == "cuda" else TINY_MOE)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _randomize(module: nn.Module, device: torch.device) -> None:
    """Matrices N(0, 0.02) (as the model suite), the routers 50x that (decisive routing)."""
    g = torch.Generator(device=device).manual_seed(whole.SEED)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.dim() >= 2:
                p.normal_(0.0, whole.INIT_STD, generator=g)
        for m in module.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.weight.mul_(50.0)


def _available_impls(config: Any, device: torch.device) -> list[str]:
    """The stock experts implementations that run here (grouped_mm needs torch._grouped_mm on this device)."""
    return [impl for impl in STOCK_IMPLS if impl != "grouped_mm"
            or hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")]


def _stock_block(block: nn.Module, impl: str) -> nn.Module:
    """A shallow copy of ``block`` (same Parameters) whose experts run ``impl``."""
    variant = copy.copy(block)
    variant._modules = dict(block._modules)
    experts = copy.copy(block.experts)
    experts.config = copy.copy(block.experts.config)
    experts.config._experts_implementation = impl
    variant._modules["experts"] = experts
    return variant


class _Timer:
    def __init__(self, device: torch.device, reps: int) -> None:
        self.device, self.reps = device, reps

    def many(self, fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
        """Median ms of each variant: alternating rounds of device-event medians on a GPU,
        ``reps`` wall-clock calls each on the CPU."""
        if self.device.type == "cuda":
            return interleaved_median_ms(fns, rounds=len(fns), warmup_ms=10, rep_ms=50)
        out = {}
        for name, fn in fns.items():
            fn()
            out[name] = statistics.median(fixed_call_times_ms(fn, self.reps, cuda=False))
        return out


def layer(config: Any, device: torch.device, dtype: torch.dtype, tokens: tuple[int, ...],
          timer: _Timer) -> list[dict[str, Any]]:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    with torch.device(device):
        stock = Qwen3MoeSparseMoeBlock(config)
    _randomize(stock, device)
    stock = stock.to(dtype)
    ours = hf_moe.replace_block("layer", stock, config)  # the same Parameter objects
    sides: dict[str, nn.Module] = {f"stock {impl}": _stock_block(stock, impl) for impl in _available_impls(config,
                                                                                                          device)}
    sides["rlkernels"] = ours
    params = list(stock.parameters())
    H = config.hidden_size
    g = torch.Generator(device=device).manual_seed(whole.SEED + 1)
    rows = []
    for T in tokens:
        x = torch.randn(1, T, H, device=device, dtype=dtype, generator=g)
        grad = torch.randn(1, T, H, device=device, dtype=dtype, generator=g)
        xg = x.detach().requires_grad_()
        fwd: dict[str, Callable[[], Any]] = {}
        train: dict[str, Callable[[], Any]] = {}
        for name, block in sides.items():
            def forward(block: nn.Module = block) -> Any:
                with torch.no_grad():
                    return block(x)

            def step(block: nn.Module = block) -> Any:
                return torch.autograd.grad(block(xg), [xg, *params], grad, allow_unused=True)

            fwd[name], train[name] = forward, step
        notes: dict[str, str] = {}
        for name in list(fwd):  # a variant that cannot run here is reported, not timed
            try:
                fwd[name]()
                train[name]()
            except Exception as exc:  # noqa: BLE001 - e.g. grouped_mm without a kernel for this device/dtype
                notes[name] = f"{type(exc).__name__}: {exc}"[:200]
                del fwd[name], train[name]
        fwd_ms, train_ms = timer.many(fwd), timer.many(train)
        n = min(BITWISE_ROWS, T)
        for name in sides:
            row: dict[str, Any] = {"workload": "layer", "side": name, "tokens": T, "note": notes.get(name)}
            if name in fwd_ms:
                with torch.no_grad():
                    batched = sides[name](x)[0, :n]
                    alone = torch.cat([sides[name](x[:, i:i + 1])[0] for i in range(n)])
                row.update(fwd_ms=fwd_ms[name], train_ms=train_ms[name],
                           bitwise=float((batched == alone).all(-1).float().mean()))
            rows.append(row)
    ours_rows = {(r["tokens"]): r for r in rows if r["side"] == "rlkernels"}
    for r in rows:
        mine = ours_rows.get(r["tokens"])
        if r["side"] != "rlkernels" and mine and r.get("fwd_ms") and mine.get("fwd_ms"):
            r["rlkernels_fwd_ratio"] = mine["fwd_ms"] / r["fwd_ms"]
            r["rlkernels_train_ratio"] = mine["train_ms"] / r["train_ms"]
    return rows


def _whole_model_rows(config: Any, device: torch.device, dtype: torch.dtype, only: tuple[str, ...],
                      sizes: whole.Sizes, reps: int) -> list[dict[str, Any]]:
    """scoring / training / decode on the whole model, once per stock experts implementation."""
    import transformers

    with torch.device(device):
        stock = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    _randomize(stock, device)
    stock.eval()
    stock.generation_config.eos_token_id = None
    stock.generation_config.pad_token_id = whole.PAD
    stock.generation_config.do_sample = False
    patched = patch_model(copy.deepcopy(stock))
    b = whole.Bench(stock, patched, device, sizes, reps, vocab=config.vocab_size)
    rows: list[dict[str, Any]] = []
    for impl in _available_impls(config, device):
        stock.config._experts_implementation = impl
        for workload in ("scoring", "training"):
            if workload in only:
                for r in getattr(whole, workload)(b):
                    if r["side"] == "stock":
                        r["side"] = f"stock {impl}"
                    elif impl != _available_impls(config, device)[0]:
                        continue  # rlkernels' rows once
                    rows.append(r)
        if "decode" in only:
            for batch in (sizes.gen_prompts, sizes.roll_prompts):
                prompts = whole.Prompts(batch, sizes.gen_prompt_min, sizes.gen_prompt_width, sizes.gen_new)
                for r in whole._generate_rows(b, f"decode B={batch}", prompts, graphed=False, eager_rlkernels=True):
                    if r["side"] == "stock":
                        r["side"] = f"stock {impl}"
                    elif impl != _available_impls(config, device)[0]:
                        continue
                    if r.get("time_ms"):
                        r["ms_per_token"] = r["time_ms"] / prompts.new
                    rows.append(r)
    ours = {r["workload"]: r for r in rows if r["side"] == "rlkernels"}
    for r in rows:
        mine = ours.get(r["workload"])
        r["rlkernels_ratio"] = (mine["time_ms"] / r["time_ms"] if r["side"] != "rlkernels" and mine
                                and mine.get("time_ms") and r.get("time_ms") else None)
        graphed = ours.get(f"{r['workload']} (graphed)")
        if r["workload"].startswith("decode") and r["side"] != "rlkernels" and graphed and graphed.get("time_ms") \
                and r.get("time_ms"):
            r["rlkernels_graphed_ratio"] = graphed["time_ms"] / r["time_ms"]
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reps = args.reps or (2 if args.quick else 5)
    config = _config(device, args.layers)
    tokens = args.tokens or (TOKENS if device.type == "cuda" else CPU_TOKENS)
    if args.quick and args.tokens is None:
        tokens = tokens[:2] + tokens[-1:] if len(tokens) > 3 else tokens
    timer = _Timer(device, reps)
    rows: list[dict[str, Any]] = []
    if "layer" in args.only:
        rows += layer(config, device, dtype, tokens, timer)
        print_table(f"MoE layer alone: hidden {config.hidden_size}, {config.num_experts} experts, top-"
                    f"{config.num_experts_per_tok}, width {config.moe_intermediate_size}, "
                    f"{str(dtype).removeprefix('torch.')}, {device.type}; ratio = rlkernels / that stock variant",
                    [r for r in rows if r["workload"] == "layer"],
                    ["tokens", "side", "fwd_ms", "train_ms", "rlkernels_fwd_ratio", "rlkernels_train_ratio",
                     "bitwise", "note"])
    model_work = tuple(w for w in args.only if w != "layer")
    if model_work:
        sizes = FULL_SIZES if device.type == "cuda" else TINY_SIZES
        model_rows = _whole_model_rows(config, device, dtype, model_work, sizes, reps)
        rows += model_rows
        print_table(f"MoE model: {config.num_hidden_layers} layers of the layer above, vocab {config.vocab_size}; "
                    "ratio = rlkernels / that stock variant", model_rows,
                    ["workload", "side", "shape", "time_ms", "ms_per_token", "tok_s", "peak_gib", "rlkernels_ratio",
                     "rlkernels_graphed_ratio", "bitwise", "note"])
    write_json(args.json, "moe", rows, {
        "model_config": config.to_dict(), "dtype": str(dtype), "bench_device": str(device), "reps": reps,
        "tokens": list(tokens), "workloads": list(args.only)})
    return rows
