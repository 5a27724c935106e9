"""``rlkernels check``: whole-model per-token log-prob invariance, stock PyTorch vs rlkernels.

A small random-initialised Qwen3 (transformers' own modelling code, config
``configs/qwen3_tiny.json``, fixed seed; no download; on a GPU widened to hidden 1024
by default, where stock kernels drift) -- or a local checkpoint -- scores the same
sequences five ways:

  (a) one sequence at a time                       (the trainer's reference)
  (b) all sequences in one right-padded batch
  (c) each sequence in chunked-prefill pieces through a KV cache
  (d) shuffled into a different order, in smaller right-padded micro-batches
  (e) as a sampler computes them: the prompts (each sequence's first half) prefilled
      as one left-padded batch with a KV cache, the rest decoded one token per step,
      each side's sampler formula (stock: the LM head's logits then log_softmax, what
      generate's scores give; rlkernels: ``linear_logprob`` on the step's final hidden
      state, what :func:`rlkernels.generate` gives)

and reports, for stock PyTorch and for rlkernels, the fraction of tokens whose
log-prob is bitwise equal in all five ways, the largest |delta log-prob| against
(a), and the time. Stock = the model as loaded (its default attention), full
logits, ``log_softmax``. rlkernels = :func:`rlkernels.patch_model` (its invariant
attention; no global mode: a patched model's forward is invariant as it is),
log-probs from ``linear_logprob``.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import platform
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable

import torch

from ..integrations.hf import attention as hf_attention
from ..integrations.hf import patch_model, token_logprobs
from ..integrations.hf.coverage import cache_kwargs, decoder_of, mode_for
from ..integrations.hf.scoring import hidden_states, logprobs_from_hidden, next_token_targets

DEFAULT_SEQS = 8
SEED = 1234
WAYS = ("single", "padded", "chunked", "shuffled", "rollout")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


DEVICE_CHOICES = "auto, cpu, cuda, cuda:N"
DTYPE_CHOICES = ", ".join(["auto"] + sorted(_DTYPES))


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto``/None -> cuda if available else cpu; ValueError for anything this machine can't run.

    Only cpu and cuda have backends; cuda needs a visible CUDA device (and cuda:N one with that index).
    """
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {str(device)!r}; expected one of {DEVICE_CHOICES}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: no CUDA device on this machine "
                             "(torch.cuda.is_available() is False); use cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {str(device)!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[str(dtype).lower().replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPE_CHOICES}") from None


def check_model_path(model_path: str) -> None:
    """Raise ValueError unless ``model_path`` is a local Hugging Face checkpoint directory (with config.json).

    Checked up front so that a typo fails before any work, not inside huggingface_hub.
    """
    import os

    if not os.path.isdir(model_path):
        raise ValueError(f"model {model_path!r} is not a directory; "
                         "expected a local Hugging Face checkpoint directory (no downloads)")
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"model directory {model_path!r} has no config.json; "
                         "expected a local Hugging Face checkpoint directory")


# The default model on a GPU: the tiny config widened to a real model's head layout
# (16 query / 8 KV heads of 64, hidden 1024). At hidden 512 stock bf16 SDPA happened to be
# bitwise invariant in every way on an H100, so the check showed nothing there.
GPU_WIDTH = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=64, vocab_size=32000)


def tiny_config_path() -> str:
    return str(resources.files("rlkernels") / "configs" / "qwen3_tiny.json")


def build_model(device: torch.device, dtype: torch.dtype, model_path: str | None = None,
                config_overrides: dict | None = None) -> torch.nn.Module:
    """A local checkpoint, or the tiny random Qwen3 (seeded, built on the CPU so every device gets the same weights)."""
    if model_path:
        from transformers import AutoModelForCausalLM
        try:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True)
        except TypeError:  # older transformers spell it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=dtype, local_files_only=True)
        return model.to(device).eval()
    from transformers import Qwen3Config, Qwen3ForCausalLM
    with open(tiny_config_path()) as f:
        cfg = json.load(f)
    cfg.pop("architectures", None)
    cfg.pop("model_type", None)
    cfg.update(config_overrides or {})
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg))
    return model.to(device=device, dtype=dtype).eval()


def draw_sequences(n: int, vocab: int, min_len: int, max_len: int, seed: int = SEED) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g) for L in lengths]


def _right_pad(seqs: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)


def _chunks(n: int, g: torch.Generator) -> list[int]:
    sizes, left = [], n
    while left:
        c = int(torch.randint(1, max(2, n // 2 + 1), (1,), generator=g))
        sizes.append(min(c, left))
        left -= sizes[-1]
    return sizes


# ---------------------------------------------------------------- the two implementations


class _Scorer:
    """Per-token log-probs of a [B, L] batch, and of one sequence fed in chunks."""

    name = ""

    def batch(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def chunked(self, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def step_logprobs(self, ids, mask, pos, cache, targets) -> torch.Tensor:  # pragma: no cover
        """The sampler's log-probs of ``targets`` [B, Lq] after feeding ``ids`` [B, Lq] with the cache."""
        raise NotImplementedError

    def rollout(self, seqs: list[torch.Tensor], prompt_lens: list[int], device: torch.device) -> list[torch.Tensor]:
        """Each sequence as a sampler computes it: the prompts prefilled as one left-padded
        batch with a KV cache, then the rest decoded one token per step (teacher-forced:
        the step feeds the sequence's own next token, so the tokens are those of
        ``seqs``). Per-sequence log-probs [len - 1], the prompt's from the prefill."""
        n, width = len(seqs), max(prompt_lens)
        ids = torch.zeros(n, width, dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.long)
        for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
            ids[i, width - p:], mask[i, width - p:] = s[:p], 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        targets = torch.full((n, width), -100, dtype=torch.long, device=device)
        for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
            if p < len(s):
                targets[i, width - 1] = s[p]
            targets[i, width - p:width - 1] = s[1:p].to(device)
        cache = _new_cache(self.model)
        parts = [self.step_logprobs(ids, mask, pos, cache, targets)]
        steps = max(len(s) - p for s, p in zip(seqs, prompt_lens))
        for t in range(1, steps):
            # Row i feeds its token at index p_i + t - 1 (or padding past its end) and scores the next.
            feed = torch.zeros(n, 1, dtype=torch.long)
            tgt = torch.full((n, 1), -100, dtype=torch.long)
            for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
                if p + t - 1 < len(s):
                    feed[i, 0] = s[p + t - 1]
                if p + t < len(s):
                    tgt[i, 0] = s[p + t]
            mask = torch.cat([mask, torch.ones(n, 1, dtype=mask.dtype, device=device)], 1)
            pos = pos[:, -1:] + 1
            parts.append(self.step_logprobs(feed.to(device), mask, pos, cache, tgt.to(device)))
        allp = torch.cat(parts, 1).cpu()
        out = []
        for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
            prompt_part = allp[i, width - p:width - 1]
            rest = allp[i, width - 1:width - 1 + len(s) - p]
            out.append(torch.cat([prompt_part, rest]))
        return out




def _new_cache(model):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


class StockScorer(_Scorer):
    name = "stock"

    def __init__(self, model) -> None:
        self.model = model

    @staticmethod
    def _pick(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float(), dim=-1)
        valid = target != -100
        picked = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
        return torch.where(valid, picked, torch.zeros_like(picked))

    def batch(self, ids, mask):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        return self._pick(logits[:, :-1], next_token_targets(ids, mask))

    def step_logprobs(self, ids, mask, pos, cache, targets):
        # What a sampler reading generate's scores gets: the LM head's logits, then log_softmax.
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                            **cache_kwargs(self.model, cache)).logits
        return self._pick(logits, targets)

    def chunked(self, ids, sizes):
        cache, parts, start = _new_cache(self.model), [], 0
        for c in sizes:
            piece = ids[:, start:start + c]
            mask = torch.ones(1, start + c, dtype=torch.long, device=ids.device)
            pos = torch.arange(start, start + c, device=ids.device)[None]
            out = self.model(input_ids=piece, attention_mask=mask, position_ids=pos, use_cache=True,
                             **cache_kwargs(self.model, cache))
            parts.append(out.logits)
            start += c
        logits = torch.cat(parts, dim=1)
        return self._pick(logits[:, :-1], next_token_targets(ids, None))


class RlkernelsScorer(_Scorer):
    name = "rlkernels"

    def __init__(self, model) -> None:
        self.model = model

    def batch(self, ids, mask):
        return token_logprobs(self.model, ids, mask)

    def step_logprobs(self, ids, mask, pos, cache, targets):
        # What rlkernels.generate gets: linear_logprob on the step's final hidden states.
        with mode_for(self.model):
            decoder = decoder_of(self.model)
            out = decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                          **cache_kwargs(decoder, cache))
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            return logprobs_from_hidden(self.model, hidden, targets)

    def chunked(self, ids, sizes):
        with mode_for(self.model):
            cache, parts, start = _new_cache(self.model), [], 0
            for c in sizes:
                piece = ids[:, start:start + c]
                mask = torch.ones(1, start + c, dtype=torch.long, device=ids.device)
                pos = torch.arange(start, start + c, device=ids.device)[None]
                # the decoder directly (what hidden_states calls), with the cache keyword it takes
                decoder = decoder_of(self.model)
                out = decoder(input_ids=piece, attention_mask=mask, position_ids=pos, use_cache=True,
                              **cache_kwargs(decoder, cache))
                parts.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])
                start += c
            hidden = torch.cat(parts, dim=1)
            return logprobs_from_hidden(self.model, hidden[:, :-1], next_token_targets(ids, None))


# ---------------------------------------------------------------- running the four ways


@dataclass
class ImplResult:
    name: str
    tokens: int = 0
    equal_by_way: dict[str, int] = field(default_factory=dict)
    equal_all: int = 0
    max_abs_diff: float = 0.0
    max_abs_diff_by_way: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def fraction(self) -> float:
        return self.equal_all / self.tokens if self.tokens else 1.0

    def as_dict(self) -> dict:
        return {"implementation": self.name, "tokens": self.tokens, "bitwise_equal_tokens": self.equal_all,
                "bitwise_equal_fraction": self.fraction,
                "bitwise_equal_fraction_by_way": {w: n / self.tokens if self.tokens else 1.0
                                                  for w, n in self.equal_by_way.items()},
                "max_abs_logprob_diff": self.max_abs_diff, "max_abs_logprob_diff_by_way": self.max_abs_diff_by_way,
                "seconds": self.seconds}


def score_four_ways(scorer: _Scorer, seqs: list[torch.Tensor], device: torch.device, *,
                    micro_batch: int, seed: int, advance: Callable[[int], None]) -> tuple[dict[str, list[torch.Tensor]], float]:
    """{way: [per-sequence log-probs [len-1] fp32 on the CPU]} and the wall time."""
    n = len(seqs)
    out: dict[str, list[torch.Tensor]] = {}
    t0 = time.perf_counter()
    with torch.no_grad():
        out["single"] = []
        for s in seqs:
            out["single"].append(scorer.batch(s[None].to(device), torch.ones(1, len(s), dtype=torch.long, device=device))[0].cpu())
            advance(1)
        ids, mask = _right_pad(seqs, device)
        full = scorer.batch(ids, mask).cpu()
        out["padded"] = [full[i, :len(s) - 1] for i, s in enumerate(seqs)]
        advance(n)
        g = torch.Generator().manual_seed(seed + 1)
        out["chunked"] = []
        for s in seqs:
            out["chunked"].append(scorer.chunked(s[None].to(device), _chunks(len(s), g))[0].cpu())
            advance(1)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 2)).tolist()
        shuffled: list[torch.Tensor | None] = [None] * n
        for b0 in range(0, n, micro_batch):
            idx = perm[b0:b0 + micro_batch]
            ids, mask = _right_pad([seqs[i] for i in idx], device)
            res = scorer.batch(ids, mask).cpu()
            for r, i in enumerate(idx):
                shuffled[i] = res[r, :len(seqs[i]) - 1]
            advance(len(idx))
        out["shuffled"] = shuffled  # type: ignore[assignment]
        # The sampler: prompts (the first half of each sequence) prefilled as a left-padded
        # batch, the rest decoded with the KV cache, each side's sampler formula.
        out["rollout"] = scorer.rollout(seqs, [max(1, len(s) // 2) for s in seqs], device)
        advance(n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def _no_progress(steps: int) -> None:
    """``advance`` where no progress is shown."""


def compare(name: str, ways: dict[str, list[torch.Tensor]], seconds: float) -> ImplResult:
    res = ImplResult(name, seconds=seconds)
    ref = ways["single"]
    res.tokens = sum(r.numel() for r in ref)
    all_eq = [torch.ones(r.shape, dtype=torch.bool) for r in ref]
    for way in WAYS[1:]:
        eq_count, worst = 0, 0.0
        for i, r in enumerate(ref):
            got = ways[way][i]
            # bitwise: compare the raw bits (catches -0.0 vs 0.0 and NaN payloads)
            eq = got.view(torch.int32) == r.view(torch.int32)
            all_eq[i] &= eq
            eq_count += int(eq.sum())
            if r.numel():
                worst = max(worst, float((got.double() - r.double()).abs().nan_to_num(nan=float("inf")).max()))
        res.equal_by_way[way], res.max_abs_diff_by_way[way] = eq_count, worst
        res.max_abs_diff = max(res.max_abs_diff, worst)
    res.equal_all = sum(int(e.sum()) for e in all_eq)
    return res


def _share(equal: int, tokens: int) -> str:
    """A share of tokens in at most 5 characters: 100%, 99.5%, 0%."""
    if not tokens:
        return "-"
    pct = 100.0 * equal / tokens
    return "100%" if equal == tokens else f"{min(pct, 99.9):.1f}%"


def _table(results: list[ImplResult], title: str):
    from rich.table import Table

    table = Table(title=title, caption="share of tokens whose log-prob is bitwise equal to (a) one-at-a-time;\n"
                  "(b) padded batch, (c) chunked prefill, (d) shuffled micro-batches,\n"
                  "(e) rollout: left-padded prefill + KV-cache decode, the sampler's formula")
    table.add_column("", no_wrap=True)
    for label in ("(b)", "(c)", "(d)", "(e)"):
        table.add_column(label, justify="right", no_wrap=True)
    table.add_column("all 5", justify="right", no_wrap=True)
    table.add_column("max|Δ|", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    for r in results:
        style = "green" if r.equal_all == r.tokens else "red"
        cells = [_share(r.equal_by_way[w], r.tokens) for w in WAYS[1:]]
        table.add_row(r.name, *cells, f"[{style}]{_share(r.equal_all, r.tokens)}[/]", f"{r.max_abs_diff:.1e}",
                      f"{r.seconds:.1f}s")
    return table


# The logit scale of a trained model's head (std of its logits), where rounding the
# logits to bf16 moves probabilities by percents; a random head gives std ~1.
TRAINED_LOGIT_STD = 6.0
GAP_TEMPERATURE = 1.0


def sampler_gap(model, sequences: list[torch.Tensor], device: torch.device, *, seed: int = SEED) -> dict:
    """How far the distribution tokens are drawn from is from the one the trainer scores.

    The patched model's final hidden states of ``sequences`` go through its head scaled to a
    trained model's logit scale (a scaled copy; the model is unchanged). The trainer scores
    ``log_softmax(z / T)``, z the fp32 logits. Stock samplers draw from the head's logits in
    the model's 16-bit dtype (bf16 for an fp32 model, as serving engines run it):
    ``softmax(round16(z) / T)``; reported here as KL(drawn || scored) per position and
    |log p_drawn - log p_scored| at tokens drawn from it. rlkernels draws with
    ``linear_sample`` from ``softmax(z / T)`` itself; its check is that every drawn token's
    log-prob is bitwise ``linear_logprob``'s.
    """
    from ..ops.linear_logprob import linear_logprob
    from ..ops.linear_sample import linear_sample
    from ..ops.matmul import linear

    head = model.get_output_embeddings()
    with torch.no_grad():
        hidden = torch.cat([hidden_states(model, s[None].to(device))[0] for s in sequences])
        z0 = linear(hidden, head.weight, out_dtype=torch.float32)
        weight = head.weight * (TRAINED_LOGIT_STD / float(z0.std()))
        z = linear(hidden, weight, out_dtype=torch.float32) / GAP_TEMPERATURE
        scored = torch.log_softmax(z.double(), dim=-1)
        low = head.weight.dtype if head.weight.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        drawn = torch.log_softmax(z.to(low).double(), dim=-1)
        kl = (drawn.exp() * (drawn - scored)).sum(dim=-1)
        g = torch.Generator(device=device).manual_seed(seed)
        tokens = torch.multinomial(drawn.exp(), 1, generator=g)[:, 0]
        at = (drawn - scored).gather(1, tokens[:, None])[:, 0].abs()
        rows = hidden.shape[0]
        ours, logp = linear_sample(hidden, weight, temperature=GAP_TEMPERATURE, seed=seed,
                                   streams=torch.arange(rows, device=device))
        same = torch.equal(logp, linear_logprob(hidden, weight, ours, temperature=GAP_TEMPERATURE))
    return {"positions": rows, "logit_std": float(z.std()), "temperature": GAP_TEMPERATURE,
            "stock_logits_dtype": str(low).replace("torch.", ""),
            "stock_kl_mean": float(kl.mean()), "stock_kl_max": float(kl.max()),
            "stock_max_abs_dlogp_at_drawn": float(at.max()), "stock_mean_abs_dlogp_at_drawn": float(at.mean()),
            "rlkernels_logp_bitwise_linear_logprob": same}


def run(device: str | None = None, dtype: str | None = None, seqs: int | None = None,
        model_path: str | None = None, json_path: str | None = None, *,
        min_len: int | None = None, max_len: int | None = None, micro_batch: int = 3,
        config_overrides: dict | None = None, console=None, cpu_threads: int | None = 1) -> dict:
    """Run the check and print the table; returns the report (its "ok": rlkernels' four answers are bitwise equal for every token).

    ``cpu_threads``: torch intra-op threads while scoring on the CPU (restored after;
    None leaves torch's setting). 1 by default: the tiny model's ops are too small to
    gain from threads, and on a busy 2-core machine OpenMP's spinning made the check
    5-10x slower. Stock PyTorch still shows mismatches single-threaded (its kernels
    pick blocking from the shape); rlkernels' bits do not depend on threads.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    n = DEFAULT_SEQS if seqs is None else int(seqs)
    if n < 1:
        raise ValueError(f"rlkernels check: seqs must be >= 1, got {seqs!r}")
    if model_path:
        check_model_path(model_path)
    if dev.type == "cuda" and model_path is None and config_overrides is None:
        config_overrides = GPU_WIDTH  # wide enough for stock GPU kernels to drift
    stock_model = build_model(dev, dt, model_path, config_overrides)
    vocab = int(stock_model.config.vocab_size)
    lo = min_len or (4 if model_path is None else 16)
    hi = max_len or (48 if model_path is None else 256)
    sequences = draw_sequences(n, vocab, lo, max(lo, hi))
    ours = patch_model(copy.deepcopy(stock_model))
    stock_attn = getattr(stock_model.config, "_attn_implementation", None)
    scorers = [StockScorer(stock_model), RlkernelsScorer(ours)]
    per_impl = 5 * n  # single, padded, chunked, shuffled and rollout: n steps each

    prev_threads = torch.get_num_threads()
    if dev.type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
    threads = torch.get_num_threads()
    results: list[ImplResult] = []
    # Progress bars on a terminal only: in a file or a pipe they would be left behind as
    # lines of bar characters above the table.
    bars = (Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                     TimeElapsedColumn(), console=console, transient=False)
            if console.is_terminal else contextlib.nullcontext(None))
    try:
        with bars as progress:
            for scorer in scorers:
                advance: Callable[[int], None] = _no_progress
                if progress is not None:
                    advance = functools.partial(progress.advance, progress.add_task(f"{scorer.name:>14}", total=per_impl))
                ways, secs = score_four_ways(scorer, sequences, dev, micro_batch=micro_batch, seed=SEED,
                                             advance=advance)
                results.append(compare(scorer.name, ways, secs))
    finally:
        torch.set_num_threads(prev_threads)

    what = model_path or (f"random Qwen3 ({tiny_config_path().rsplit('/', 1)[-1]}"
                          f"{', hidden ' + str(config_overrides['hidden_size']) if config_overrides and 'hidden_size' in config_overrides else ''}, seed {SEED})")
    title = (f"per-token log-prob invariance\n{what}\n{n} sequences ({sum(len(s) - 1 for s in sequences)} scored tokens), "
             f"lengths {lo}..{hi}, {dev.type}{f' ({threads} thread(s))' if dev.type == 'cpu' else ''} {str(dt)[6:]}\nattention: stock {stock_attn}, rlkernels {hf_attention.NAME}")
    console.print(_table(results, title))
    ok = results[-1].equal_all == results[-1].tokens
    console.print(f"rlkernels: {'[green]all tokens bitwise equal[/]' if ok else '[red]MISMATCH[/]'} across "
                  f"one-at-a-time, padded, chunked-prefill, shuffled batches and the sampler's rollout.")
    gap = sampler_gap(ours, sequences, dev)
    console.print(f"sampling distribution vs the trainer's, {gap['positions']} positions, head scaled to a trained "
                  f"model's logit std {gap['logit_std']:.1f}, T = {gap['temperature']:g}: stock (draws from "
                  f"{gap['stock_logits_dtype']} logits) KL mean {gap['stock_kl_mean']:.2e}, max {gap['stock_kl_max']:.2e}; |d log p| at drawn "
                  f"tokens mean {gap['stock_mean_abs_dlogp_at_drawn']:.3f}, max "
                  f"{gap['stock_max_abs_dlogp_at_drawn']:.3f}. rlkernels draws from the scored distribution "
                  f"(linear_sample): gap 0, drawn tokens' log-probs "
                  f"{'bitwise linear_logprob' if gap['rlkernels_logp_bitwise_linear_logprob'] else '[red]NOT bitwise[/]'}.",
                  highlight=False)
    ok &= gap["rlkernels_logp_bitwise_linear_logprob"]
    import transformers
    payload = {
        "ok": ok, "device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "dtype": str(dt)[6:], "model": what, "seqs": n, "lengths": [len(s) for s in sequences],
        "stock_attention": stock_attn, "micro_batch": micro_batch,
        "cpu_threads": threads if dev.type == "cpu" else None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "results": [r.as_dict() for r in results],
        "sampler_gap": gap,
    }
    if json_path:
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=2)
    return payload
