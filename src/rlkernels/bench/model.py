"""Benchmark: a whole Hugging Face model, stock vs rlkernels, on the jobs of an RL step.

    rlkernels bench model [--config qwen3-1.7b|qwen3-8b|tiny|PATH.json] [--layers N] [--device cuda|cpu]
        [--only scoring,training,short,generate,rollout,long] [--reps R] [--graphed] [--json PATH] [--quick]

One random-weight model, built from transformers' own classes (no download) and run
two ways in the same process:

- **stock**: as transformers builds it (SDPA attention), log-probs as trainers take
  them: ``model(ids, attention_mask=mask).logits``, then in fp32
  ``logits.gather(-1, next_tokens) - logsumexp(logits, -1)``; ``model.generate``.
- **rlkernels**: a deep copy through :func:`rlkernels.patch_model`,
  :func:`rlkernels.token_logprobs` and :func:`rlkernels.generate`.

Workloads: ``scoring`` (right-padded batch, no grad), ``training`` (forward + backward of
a per-token policy-gradient loss), ``short`` (both on one unpadded 64-token sequence, where
the host's per-call path shows), ``generate`` (left-padded prompts, greedy, a fixed
number of new tokens; on a GPU also ``rlkernels.generate(..., cuda_graph=True)``;
``--graphed`` adds transformers' compiled static-cache generate), ``rollout`` (the same
rows with long prompts, where a decode step's time is the attention reading the KV cache)
and ``long`` (one long sequence per length). Per workload and side: median ms of the
timed calls (CUDA events on a GPU, wall clock on the CPU), tokens/s, peak allocated GiB
(less the other side's weights, which share the device), the time ratio
rlkernels / stock, and the bitwise fraction:

- scoring: valid tokens whose log-prob in the batch equals (``==``, i.e. torch.equal per
  token) the log-prob of the same sequence scored alone (B=1, unpadded);
- long: the first quarter's log-probs in the full-length pass vs that prefix scored alone;
- generate, rollout: new tokens whose sampler log-prob (stock: ``log_softmax`` of generate's
  scores; rlkernels: what ``rlkernels.generate`` returns) equals the trainer's log-prob
  of the finished sequences (the side's own scoring formula; stock's, like TRL's, passes
  no position_ids, so transformers numbers a left-padded row's positions from the padding).

Model shapes: ``qwen3-1.7b`` (default on CUDA), ``qwen3-8b``, ``tiny`` (the CPU check's
2-layer Qwen3, with small batches; the default on the CPU) or a transformers config
JSON file. bf16 on CUDA, fp32 on the CPU.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..integrations.hf import generate as rlk_generate, patch_model, release_decode_graphs, token_logprobs
from .common import fixed_call_times_ms, only_arg, print_table, write_json

NEEDS_CUDA = False  # `--device cpu --config tiny` runs anywhere; the CUDA default is checked at parse time

SEED = 0
INIT_STD = 0.02
# Bytes of fp32 logits one scoring call of the bitwise checks may hold (micro-batches beyond).
LOGITS_BUDGET = 8 << 30
PAD = 0
WORKLOADS = ("scoring", "training", "short", "generate", "rollout", "long")

_QWEN3 = dict(model_type="qwen3", head_dim=128, vocab_size=151936, rope_theta=1e6, max_position_embeddings=40960,
              rms_norm_eps=1e-6)
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Sizes:
    """Batch shapes of the workloads."""

    score_batch: int
    score_len: int  # right-padded width; lengths drawn from [score_len // 2, score_len]
    score_alone: int  # sequences of the batch also scored alone, for the bitwise fraction
    train_batch: int
    train_len: int
    gen_prompts: int
    gen_prompt_min: int
    gen_prompt_width: int  # prompts left-padded to this width; lengths in [gen_prompt_min, width]
    gen_new: int
    roll_prompts: int  # rollout: long left-padded prompts, lengths in [roll_prompt_min, width]
    roll_prompt_min: int
    roll_prompt_width: int
    roll_new: int
    long_lens: tuple[int, ...]
    short_len: int = 64  # short: one unpadded sequence, scored and trained, where host time shows


FULL = Sizes(8, 1024, 3, 4, 1024, 16, 64, 128, 64, 16, 2048, 4096, 64, (8192, 32768), 64)
TINY = Sizes(4, 32, 3, 2, 32, 4, 4, 8, 4, 2, 16, 24, 4, (64, 256), 16)


# ---------------------------------------------------------------- options

def _config_arg(value: str) -> str:
    if value in (*CONFIGS, "tiny") or os.path.isfile(value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither one of {', '.join((*CONFIGS, 'tiny'))} "
                                     "nor a transformers config JSON file")


def _device_arg(value: str) -> str:
    if value == "cpu":
        return value
    if value == "cuda" or value.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{value!r}: torch sees no CUDA GPU here; "
                                             "`--device cpu --config tiny` runs on the CPU")
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: expected cuda, cuda:N or cpu")


def _only_arg(value: str) -> tuple[str, ...]:
    return only_arg(value, WORKLOADS)


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=_config_arg, default=None,
                        help="qwen3-1.7b (default on CUDA), qwen3-8b, tiny (default on the CPU; small batches) "
                             "or a transformers config JSON file")
    parser.add_argument("--layers", type=_positive, default=None, help="override the number of decoder layers")
    parser.add_argument("--device", type=_device_arg, default=None,
                        help="cuda (default when available), cuda:N or cpu")
    parser.add_argument("--only", type=_only_arg, default=WORKLOADS, metavar="W[,W...]",
                        help=f"workloads to run (default: all of {','.join(WORKLOADS)})")
    parser.add_argument("--reps", type=_positive, default=None,
                        help="timed calls per workload and side (default 5, 2 with --quick); generate and long "
                             "take half as many, rounded up")
    parser.add_argument("--graphed", action="store_true",
                        help="also time generate with CUDA graphs: stock cache_implementation='static' (which "
                             "transformers compiles; errors are recorded) and rlkernels.generate(cuda_graph=True) "
                             "where that keyword exists")


# ---------------------------------------------------------------- the model, two ways

def model_config(name: str, layers: int | None) -> Any:
    """The transformers config of a preset name, ``tiny`` or a JSON file, ``layers`` overriding the depth."""
    import transformers

    if name == "tiny":
        from ..check.model import tiny_config_path
        name = tiny_config_path()
    if name in CONFIGS:
        fields = dict(CONFIGS[name])
    else:
        with open(name) as f:
            fields = json.load(f)
    if layers is not None:
        fields["num_hidden_layers"] = layers  # before construction: configs derive per-layer lists from it
    fields.pop("architectures", None)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise SystemExit(f"rlkernels bench model: {name}: the config has no model_type")
    return transformers.AutoConfig.for_model(model_type, **fields)


def build_models(config: Any, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """(stock, rlkernels): the random-weight model with SDPA attention and a patched deep copy.

    Every matrix (embeddings included) is drawn from N(0, INIT_STD) with a fixed seed and
    norm weights stay 1, so activations stay finite at any depth.
    """
    import transformers

    with torch.device(device):
        stock = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    g = torch.Generator(device=device).manual_seed(SEED)
    with torch.no_grad():
        for _, p in sorted(stock.named_parameters()):
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD, generator=g)
    stock.eval()
    # Greedy, a fixed number of new tokens: no EOS can end a row early.
    stock.generation_config.eos_token_id = None
    stock.generation_config.pad_token_id = PAD
    stock.generation_config.do_sample = False
    patched = patch_model(copy.deepcopy(stock))
    return stock, patched


def stock_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L-1] fp32 log-probs of the next tokens, as trainers compute them (TRL's fp32 formula)."""
    logits = model(ids, attention_mask=mask).logits[:, :-1].float()
    return logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def rlkernels_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return token_logprobs(model, ids, mask)


Scorer = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------- measurement

@dataclass
class Bench:
    stock: nn.Module
    patched: nn.Module
    device: torch.device
    sizes: Sizes
    reps: int
    vocab: int

    def sides(self) -> list[tuple[str, nn.Module, Scorer]]:
        return [("stock", self.stock, stock_logprobs), ("rlkernels", self.patched, rlkernels_logprobs)]

    def weights_bytes(self, model: nn.Module) -> int:
        tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def time(self, side: str, fn: Callable[[], Any], heavy: bool) -> tuple[float, float | None]:
        """Median ms of ``fn`` after warm-up, and peak allocated GiB during the timed calls
        less the other side's weights (None on the CPU)."""
        warmup, reps = (1, math.ceil(self.reps / 2)) if heavy else (2, self.reps)
        cuda = self.device.type == "cuda"
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        times = fixed_call_times_ms(fn, reps, cuda)
        if not cuda:
            return statistics.median(times), None
        other = self.patched if side == "stock" else self.stock
        peak = torch.cuda.max_memory_allocated(self.device) - self.weights_bytes(other)
        return statistics.median(times), peak / 2**30

    def tokens(self, *shape: int, low: int = 3, seed: int = SEED) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(low, self.vocab, shape, generator=g).to(self.device)

    def lengths(self, n: int, low: int, high: int, seed: int = SEED) -> list[int]:
        g = torch.Generator().manual_seed(seed + 1)
        return torch.randint(low, high + 1, (n,), generator=g).tolist()


def _free(device: torch.device) -> None:
    # The graphed generate keeps its cache and graph per model between calls; each
    # workload's peak is measured without the previous one's.
    release_decode_graphs()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _row(workload: str, side: str, shape: str, tokens: int, ms: float | None, peak: float | None,
         bitwise: float | None = None, **extra: Any) -> dict[str, Any]:
    return {"workload": workload, "side": side, "shape": shape, "tokens": tokens, "time_ms": ms,
            "tok_s": tokens / ms * 1e3 if ms else None, "peak_gib": peak, "bitwise": bitwise, **extra}


def _fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of positions where ``a`` equals ``b`` (torch.equal per token)."""
    return float((a == b).float().mean()) if a.numel() else 1.0


def _right_padded(b: Bench, batch: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    lengths = b.lengths(batch, width // 2, width, seed)
    ids = b.tokens(batch, width, seed=seed)
    mask = (torch.arange(width, device=b.device)[None] < torch.tensor(lengths, device=b.device)[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask, lengths


# ---------------------------------------------------------------- workloads

def scoring(b: Bench) -> list[dict[str, Any]]:
    s = b.sizes
    ids, mask, lengths = _right_padded(b, s.score_batch, s.score_len, seed=1)
    rows = []
    for side, model, score in b.sides():
        with torch.no_grad():
            ms, peak = b.time(side, lambda: score(model, ids, mask), heavy=False)
            batch = score(model, ids, mask)
            picked = lengths[:s.score_alone]
            in_batch = torch.cat([batch[i, :n - 1] for i, n in enumerate(picked)])
            alone = torch.cat([score(model, ids[i:i + 1, :n], mask[i:i + 1, :n])[0] for i, n in enumerate(picked)])
        rows.append(_row("scoring", side, f"{s.score_batch}x{s.score_len}", int(mask.sum()), ms, peak,
                         _fraction(in_batch, alone)))
        del batch, in_batch, alone
        _free(b.device)
    return rows


def training(b: Bench, workload: str = "training", ids: torch.Tensor | None = None,
             mask: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """A policy-gradient step's forward and backward on a right-padded batch (``ids``,
    ``mask``: another batch, named ``workload``)."""
    s = b.sizes
    if ids is None or mask is None:
        ids, mask, _ = _right_padded(b, s.train_batch, s.train_len, seed=2)
    batch, width = ids.shape
    valid = (mask[:, 1:] * mask[:, :-1]).float()
    g = torch.Generator().manual_seed(SEED + 3)
    adv = torch.randn(batch, width - 1, generator=g).to(b.device)
    rows = []
    for side, model, score in b.sides():
        def step(model: nn.Module = model, score: Scorer = score) -> None:
            model.zero_grad(set_to_none=True)
            logp = score(model, ids, mask)
            (-(logp * adv * valid).sum() / valid.sum()).backward()

        ms, peak = b.time(side, step, heavy=False)
        model.zero_grad(set_to_none=True)
        rows.append(_row(workload, side, f"{batch}x{width}", int(mask.sum()), ms, peak))
        _free(b.device)
    return rows


def short(b: Bench) -> list[dict[str, Any]]:
    """One unpadded sequence of ``short_len`` tokens, scored and trained: the GPU work is
    small, so the time is mostly the host's per-call path (each side's Python and launches)."""
    width = b.sizes.short_len
    ids = b.tokens(1, width, seed=5)
    mask = torch.ones_like(ids)
    rows = []
    for side, model, score in b.sides():
        with torch.no_grad():
            ms, peak = b.time(side, lambda: score(model, ids, mask), heavy=False)
        rows.append(_row("short scoring", side, f"1x{width}", width, ms, peak))
        _free(b.device)
    return rows + training(b, "short training", ids, mask)


@dataclass(frozen=True)
class Prompts:
    """A generate workload: ``count`` prompts left-padded to ``width``, lengths drawn from
    [min_len, width], then ``new`` tokens each."""

    count: int
    min_len: int
    width: int
    new: int


def _left_padded_prompts(b: Bench, p: Prompts) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = b.lengths(p.count, p.min_len, p.width, seed=4)
    ids = b.tokens(p.count, p.width, seed=4)
    pos = torch.arange(p.width, device=b.device)[None]
    mask = (pos >= p.width - torch.tensor(lengths, device=b.device)[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask


def _stock_sampled(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                   kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences, sampler log-probs [B, T]): log_softmax of the scores generate drew from."""
    out = model.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **kw)
    new = out.sequences[:, ids.shape[1]:]
    logp = torch.stack([torch.log_softmax(sc.float(), dim=-1) for sc in out.scores], dim=1)
    return out.sequences, logp.gather(-1, new[..., None]).squeeze(-1)


def generate(b: Bench, graphed: bool) -> list[dict[str, Any]]:
    s = b.sizes
    return _generate_rows(b, "generate", Prompts(s.gen_prompts, s.gen_prompt_min, s.gen_prompt_width, s.gen_new),
                          graphed, eager_rlkernels=True)


def rollout(b: Bench, graphed: bool) -> list[dict[str, Any]]:
    """Long prompts, where a decode step reads a long KV cache: the generate rows at that shape."""
    s = b.sizes
    return _generate_rows(b, "rollout", Prompts(s.roll_prompts, s.roll_prompt_min, s.roll_prompt_width, s.roll_new),
                          graphed, eager_rlkernels=True)


def _generate_rows(b: Bench, name: str, prompts: Prompts, graphed: bool,
                   eager_rlkernels: bool) -> list[dict[str, Any]]:
    """Rows of workload ``name`` (stock and rlkernels eager) and ``name (graphed)``."""
    ids, mask = _left_padded_prompts(b, prompts)
    rows_per_score = max(1, LOGITS_BUDGET // ((prompts.width + prompts.new) * b.vocab * 4))
    kw = dict(max_new_tokens=prompts.new, min_new_tokens=prompts.new, do_sample=False, pad_token_id=PAD)
    # rlkernels refuses min_new_tokens (it draws from a distribution without EOS); no EOS
    # at all gives the same full-length decode to time.
    rk_kw = dict(max_new_tokens=prompts.new, do_sample=False, pad_token_id=PAD, eos_token_id=[])
    # (workload, side, timed call, sequences and sampler log-probs for the bitwise check) or a note
    cases: list[tuple[str, str, Any]] = [
        (name, "stock", (lambda: b.stock.generate(ids, attention_mask=mask, **kw),
                         lambda: _stock_sampled(b.stock, ids, mask, kw))),
    ]
    if eager_rlkernels:
        cases.append((name, "rlkernels", (lambda: rlk_generate(b.patched, ids, mask, **rk_kw),
                                          lambda: rlk_generate(b.patched, ids, mask, **rk_kw))))
    wl = f"{name} (graphed)"
    if b.device.type != "cuda":
        cases += [(wl, side, "skipped: CUDA graphs need a GPU") for side in ("stock", "rlkernels")]
    else:
        if graphed:  # transformers compiles its static-cache step: minutes of compilation per shape
            static = dict(kw, cache_implementation="static")
            cases.append((wl, "stock", (lambda: b.stock.generate(ids, attention_mask=mask, **static),
                                        lambda: _stock_sampled(b.stock, ids, mask, static))))
        gkw = dict(rk_kw, cuda_graph=True)
        cases.append((wl, "rlkernels", (lambda: rlk_generate(b.patched, ids, mask, **gkw),
                                        lambda: rlk_generate(b.patched, ids, mask, **gkw))))
    full_mask = torch.cat([mask, torch.ones(mask.shape[0], prompts.new, dtype=mask.dtype, device=b.device)], dim=1)
    scorers = {side: (model, score) for side, model, score in b.sides()}
    shape = f"{prompts.count}x({prompts.width}+{prompts.new})"
    tokens = prompts.count * prompts.new
    rows = []
    for workload, side, case in cases:
        if isinstance(case, str):
            rows.append(_row(workload, side, shape, tokens, None, None, note=case))
            continue
        timed, sampled = case
        try:
            with torch.no_grad():
                ms, peak = b.time(side, timed, heavy=True)
                sequences, sampler = sampled()
                model, score = scorers[side]
                # The trainer scores in micro-batches: stock's fp32 logits of a long batch would not fit.
                trainer = torch.cat([score(model, sequences[i:i + rows_per_score], full_mask[i:i + rows_per_score])
                                     for i in range(0, len(sequences), rows_per_score)])[:, ids.shape[1] - 1:]
            rows.append(_row(workload, side, shape, tokens, ms, peak, _fraction(sampler, trainer)))
        except Exception as exc:  # the graphed variants lean on compile / capture paths that may not hold
            if workload == name:
                raise
            rows.append(_row(workload, side, shape, tokens, None, None, note=f"{type(exc).__name__}: {exc}"[:200]))
        _free(b.device)
    return rows


def long(b: Bench) -> list[dict[str, Any]]:
    rows = []
    ids_all = b.tokens(1, max(b.sizes.long_lens), seed=5)
    for n in b.sizes.long_lens:
        ids = ids_all[:, :n]
        mask = torch.ones_like(ids)
        prefix = n // 4
        for side, model, score in b.sides():
            note = None
            try:
                with torch.no_grad():
                    ms, peak = b.time(side, lambda: score(model, ids, mask), heavy=True)
                    full = score(model, ids, mask)[0, :prefix - 1]
                    alone = score(model, ids[:, :prefix], mask[:, :prefix])[0]
                rows.append(_row(f"long {n}", side, f"1x{n}", n, ms, peak, _fraction(full, alone),
                                 bitwise_ref=f"first {prefix} tokens scored alone"))
                del full, alone
            except torch.cuda.OutOfMemoryError as exc:
                note = f"skipped: out of memory ({str(exc).splitlines()[0][:120]})"
            if note is not None:  # outside the except block, so the traceback's tensors are gone
                _free(b.device)
                rows.append(_row(f"long {n}", side, f"1x{n}", n, None, None, note=note))
            _free(b.device)
    return rows


# ---------------------------------------------------------------- entry point

def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stock = {r["workload"]: r["time_ms"] for r in rows if r["side"] == "stock"}
    for r in rows:
        base = stock.get(r["workload"])
        r["ratio"] = r["time_ms"] / base if r["side"] == "rlkernels" and r["time_ms"] and base else None
        # A rollout engine decodes graphed; what it replaces is stock's eager generate.
        family = r["workload"].split(" ")[0]
        eager = stock.get(family) if family in ("generate", "rollout") else None
        r["vs_stock_eager"] = r["time_ms"] / eager if r["time_ms"] and eager else None
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = args.config or ("qwen3-1.7b" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)  # CUDA events and the peak counters follow the current device
    config = model_config(name, args.layers)
    sizes = TINY if name == "tiny" else FULL
    if args.quick:
        sizes = Sizes(**{**asdict(sizes), "long_lens": sizes.long_lens[:1]})
    reps = args.reps or (2 if args.quick else 5)
    stock, patched = build_models(config, device, dtype)
    b = Bench(stock, patched, device, sizes, reps, vocab=config.vocab_size)
    rows: list[dict[str, Any]] = []
    for workload in WORKLOADS:
        if workload in args.only:
            rows += (globals()[workload](b, args.graphed) if workload in ("generate", "rollout")
                     else globals()[workload](b))
    _with_ratios(rows)
    title = (f"model bench: {name}, {config.num_hidden_layers} layers, {str(dtype).removeprefix('torch.')}, "
             f"{device.type}; time ratio = rlkernels / stock")
    shown = [{**r, "time ms": r["time_ms"], "tok/s": r["tok_s"], "peak GiB": r["peak_gib"],
              "bitwise %": None if r["bitwise"] is None else 100.0 * r["bitwise"]} for r in rows]
    print_table(title, shown, ["workload", "side", "shape", "time ms", "tok/s", "peak GiB", "ratio",
                               "vs_stock_eager", "bitwise %", "note"])
    write_json(args.json, "model", rows, {
        "config": name, "model_config": config.to_dict(),
        "layers": config.num_hidden_layers, "dtype": str(dtype), "bench_device": str(device), "reps": reps,
        "workloads": list(args.only), "sizes": asdict(sizes), "graphed": args.graphed})
    return rows
