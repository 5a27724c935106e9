"""Benchmark: an RL step's rollout, continuous batching against one static batch and the peers.

    rlkernels bench rollout [--config qwen3-1.7b|qwen3-8b|tiny|PATH.json] [--layers N] [--device cuda|cpu]
        [--prompts P] [--n N] [--prompt-lens LO,HI] [--max-new T] [--mean-len M] [--max-batch B]
        [--peers generate_batch,compiled] [--peer-prompts P] [--step-batches 16,64,256] [--step-spacing 256]
        [--own-prompt-reads] [--phases] [--kernels K] [--json PATH] [--quick]

The workload is an RL step's: P prompts (lengths uniform in [LO, HI]) × N samples each,
drawn at T = 1 until EOS or T new tokens. A random-weight model's EOS token would almost
never be drawn, so the EOS row of the LM head is zeroed and the head given a bias, b at
EOS and 0 elsewhere (:func:`scale_eos_row`): p(EOS) is then about the same at every
position, and b is set, along sampled decodes of the first 16 prompts (T tokens each, no
EOS), to the rate that ends a sample after M tokens on average (cut at T), as RL
responses do; the JSON's rows give the tokens actually drawn. The same head serves every
side.

Rows (tokens/s counts the new tokens each side kept, EOS included, up to each sample's end):

- ``rollout``: :func:`rlkernels.rollout` (continuous batching, graphed on CUDA);
- ``generate``: :func:`rlkernels.generate` with ``cuda_graph=True``, the P × N samples as one
  left-padded static batch (every slot runs until the longest sample ends);
- ``generate_batch``: transformers' continuous batching (``model.generate_batch``) on the
  stock model, on the first ``--peer-prompts`` prompts (it is slow); ``compiled``:
  transformers' static-cache ``generate`` compiled, the same subset as one batch.

The decode step against its HBM floor, at each batch of ``--step-batches`` (prompts of 512):
step time = (graphed greedy ``generate`` of 160 new tokens - of 32) / 128, the medians of
three calls each after one of each; bytes = the
model's parameters + the KV cache the step reads, at the measured device-to-device copy
bandwidth. Launches per layer: the kernels of one eager decode step (profiler) / layers.

``--kernels K`` profiles one more rollout and reports its K kernels of most device time
(launches, total, share of all kernel time; on the CPU, the operators of most self time).

``--phases`` runs the rollout once more with each decode step timed (CUDA events around
its launch): by step batch, the steps' median time and rows in use, and on CUDA each
step's floor (the weights and the keys of the rows in use read once) and the group's
time over its floor.

On CUDA the ``rollout`` row also gives its decode floor (:func:`decode_floor_s`: the
fewest steps any schedule takes, each reading the weights once, and every new token its
sample's keys and values once, at the measured copy bandwidth) and its wall time over it,
and the same floor with each prompt's keys read once per step for all its samples
(``shared_floor_s``), as the rollout's attention reads them.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import time
from typing import Any

import torch
from torch import nn

from ..integrations.hf import decode, generate as rlk_generate, release_decode_graphs
from ..integrations.hf.continuous_batching import _rollout as rlk_rollout_impl
from . import model as whole
from .common import only_arg, print_table, write_json

NEEDS_CUDA = False  # `--device cpu --config tiny` runs anywhere
STEP_REPS = 3  # timed calls of each length per decode-step row (medians)
PEERS = ("generate_batch", "compiled")


def _pair(value: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in value.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {value!r}")
    return lo, hi


def _ints(value: str) -> tuple[int, ...]:
    out = tuple(int(v) for v in value.split(",") if v.strip())
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return out


def _peers(value: str) -> tuple[str, ...]:
    return () if value in ("", "none") else only_arg(value, PEERS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=whole._config_arg, default=None, help="qwen3-1.7b (CUDA default), "
                        "qwen3-8b, tiny (CPU default) or a transformers config JSON")
    parser.add_argument("--layers", type=whole._positive, default=None, help="override the number of layers")
    parser.add_argument("--device", type=whole._device_arg, default=None, help="cuda (default if present) or cpu")
    parser.add_argument("--prompts", type=whole._positive, default=None, help="prompts (64; tiny: 6)")
    parser.add_argument("--n", type=whole._positive, default=4, help="samples per prompt")
    parser.add_argument("--prompt-lens", type=_pair, default=None, help="prompt lengths LO,HI (64,512; tiny: 4,24)")
    parser.add_argument("--max-new", type=whole._positive, default=None, help="max new tokens (512; tiny: 24)")
    parser.add_argument("--mean-len", type=whole._positive, default=None,
                        help="mean response length the EOS row is scaled for (240; tiny: 8)")
    parser.add_argument("--max-batch", type=whole._positive, default=None, help="rollout's max_batch (default: its own)")
    parser.add_argument("--peers", type=_peers, default=PEERS, help="transformers' engines to time: "
                        "generate_batch,compiled (or none)")
    parser.add_argument("--peer-prompts", type=whole._positive, default=16, help="prompts the peers run")
    parser.add_argument("--step-batches", type=_ints, default=(16, 64, 256), help="decode-step batches (CUDA)")
    parser.add_argument("--step-spacing", type=_ints, default=(), help="rollout variants timed beside the default: "
                        "its step batches spaced by each of these (e.g. 256 for powers of two up to 256)")
    parser.add_argument("--own-prompt-reads", action="store_true", help="also time the rollout with every row "
                        "reading its own copy of its prompt's keys (shared prompt reads off; the same bits)")
    parser.add_argument("--phases", action="store_true", help="time the rollout's decode steps one by one, each "
                        "against the floor of the rows it runs (by step batch)")
    parser.add_argument("--kernels", type=whole._positive, default=None, metavar="K",
                        help="profile one rollout and report its K kernels of most device time (the CPU: "
                        "operators of most self time)")


# ---------------------------------------------------------------- the workload


def _decode_hidden(model: nn.Module, prompts: list[torch.Tensor], steps: int) -> torch.Tensor:
    """Final hidden states along sampled decodes: ``prompts`` as one left-padded batch,
    ``steps`` tokens drawn at T = 1 with no EOS, the hidden state that draws each of them:
    [P, steps, D] fp32."""
    device = prompts[0].device
    ids, mask = _left_padded(prompts, device)
    with torch.no_grad():
        seq, _ = rlk_generate(model, ids, mask, max_new_tokens=steps, do_sample=True, seed=0, eos_token_id=[])
        full = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1]:])], dim=1)
        hidden = model.get_decoder()(input_ids=seq, attention_mask=full).last_hidden_state
    return hidden[:, ids.shape[1] - 1:-1].float()


@torch.no_grad()
def scale_eos_row(models: list[nn.Module], prompts: list[torch.Tensor], eos: int, mean_len: int,
                  steps: int) -> float:
    """Make EOS end samples after ``mean_len`` tokens on average (cut at ``steps``), at about
    the same rate at every position, as a geometric length would. Returns the EOS logit b.

    The EOS row of each model's LM head is zeroed and the head gets a bias that is b at EOS
    and 0 elsewhere (the other logits keep their bits), so p(EOS) = sigmoid(b - the
    log-sum-exp of the other logits): the final hidden states are RMS-normed, so that
    log-sum-exp moves little from one position to the next, where a row of the head would
    follow the hidden state's direction and end some prompts at once and others never. b
    is found by bisection on the mean length along sampled decodes of ``prompts`` (``steps``
    tokens each, no EOS: EOS moves only its own probability, so a decode that has not ended
    is one of these). The first model decodes; all share the head's EOS logit."""
    h = _decode_hidden(models[0], prompts, steps)  # [P, T, D]
    weight = models[0].get_output_embeddings().weight
    lse_rest = []
    for rows in h:  # [T, V] logits, one prompt at a time
        logits = rows @ weight.float().t()
        logits[:, eos] = float("-inf")
        lse_rest.append(torch.logsumexp(logits, dim=-1))
    lse_rest = torch.stack(lse_rest).double()

    def mean_length(b: float) -> float:
        p_end = torch.sigmoid(b - lse_rest)
        # A sample draws token t where none of tokens 0 .. t-1 was EOS.
        alive = torch.cumprod(torch.cat([torch.ones_like(p_end[:, :1]), 1 - p_end[:, :-1]], dim=1), dim=1)
        return float(alive.sum(1).mean())

    lo, hi = float(lse_rest.min()) - 40.0, float(lse_rest.max()) + 10.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_length(mid) > mean_len else (lo, mid)
    b = (lo + hi) / 2
    for m in models:
        head = m.get_output_embeddings()
        head.weight[eos] = 0
        if head.bias is None:
            head.bias = nn.Parameter(head.weight.new_zeros(head.weight.shape[0]), requires_grad=False)
        head.bias.zero_()
        head.bias[eos] = b
    return b


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn) -> tuple[Any, float]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, (time.perf_counter() - start) * 1e3


def _kept(seq_new: torch.Tensor, eos: int) -> int:
    """New tokens up to and including each row's first EOS."""
    is_eos = seq_new == eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], seq_new.shape[1],
                                                                                   dtype=torch.long))
    return int(first.sum())


def _left_padded(prompts: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), whole.PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p.cpu(), 1
    return ids.to(device), mask.to(device)


def _row(engine: str, samples: int, tokens: int, ms: float, **extra: Any) -> dict[str, Any]:
    return dict(engine=engine, samples=samples, new_tokens=tokens, wall_s=round(ms / 1e3, 3),
                tok_per_s=round(tokens / (ms / 1e3), 1), **extra)


def _warm_rollout(model, prompts, n, max_new, eos, max_batch, **variant: Any):
    """The workload's rollout call (seed 0), after one call that compiles and captures."""
    def call():
        return rlk_rollout_impl(model, prompts, n=n, max_new_tokens=max_new, seed=0, eos_token_id=eos,
                                max_batch=max_batch, **variant)
    call()
    return call


def _rollout_row(model, prompts, n, max_new, eos, max_batch, device, spacing=None,
                 bandwidth: float | None = None, shared_reads: bool = True) -> dict[str, Any]:
    """``rollout``'s row; ``spacing``: its step batches' spacing (None: the default), or
    ``shared_reads=False`` (every row reads its own prompt copy): a variant timed beside
    it. ``bandwidth`` (GB/s): with it, the row's decode floor (:func:`decode_floor_s`) and
    its wall time over that floor."""
    variant: dict[str, Any] = {} if spacing is None else {"step_spacing": spacing}
    if not shared_reads:
        variant["shared_prompt_reads"] = False

    call = _warm_rollout(model, prompts, n, max_new, eos, max_batch, **variant)
    _release(device)  # the warm-up's cache, before the timed call allocates its own
    results, ms = _timed(device, call)
    kept = decode.kept_state("rollout", model)  # a graphed call's engine: the rows it chose
    rows = kept.max_batch if kept is not None else max_batch
    # No reference to the engine may outlive the release: its cache is most of the memory
    # the next row (a static batch with a cache of its own) needs.
    del kept
    release_decode_graphs(model)
    _release(device)
    name = ("rollout" if spacing is None else f"rollout, step batches spaced {spacing}") + (
        "" if shared_reads else ", own prompt reads")
    extra = dict(variant)
    if bandwidth is not None:
        samples = [(len(prompts[r.prompt]), len(r.tokens)) for r in results]
        floor_s = decode_floor_s(model, samples, bandwidth)
        shared_s = decode_floor_s(model, samples, bandwidth, [r.prompt for r in results])
        extra.update(decode_floor_s=round(floor_s, 3), floor_ratio=round(ms / 1e3 / floor_s, 2),
                     shared_floor_s=round(shared_s, 3))
    return _row(name, len(results), sum(len(r.tokens) for r in results), ms,
                finished=sum(r.finished for r in results), max_batch=rows, **extra)


def _generate_row(model, prompts, n, max_new, eos, device) -> dict[str, Any]:
    rows = [p for p in prompts for _ in range(n)]
    ids, mask = _left_padded(rows, device)
    streams = torch.arange(len(rows), device=device)
    graphed = device.type == "cuda"

    def call():
        return rlk_generate(model, ids, mask, max_new_tokens=max_new, do_sample=True, temperature=1.0, seed=0,
                            streams=streams, eos_token_id=eos, cuda_graph=graphed)
    _release(device)
    call()
    (seq, _), ms = _timed(device, call)
    out = _row("generate" + (" graphed" if graphed else ""), len(rows), _kept(seq[:, ids.shape[1]:], eos), ms)
    release_decode_graphs(model)
    _release(device)
    return out


def _peer_rows(stock, prompts, n, max_new, eos, device, peers) -> list[dict[str, Any]]:
    from transformers import GenerationConfig

    rows = []
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           eos_token_id=eos, pad_token_id=whole.PAD, num_return_sequences=1)
    samples = [p for p in prompts for _ in range(n)]
    if "generate_batch" in peers:
        try:
            inputs = [p.tolist() for p in samples]
            stock.generate_batch(inputs=inputs[: max(1, len(inputs) // 8)], generation_config=cfg)  # warm-up
            out, ms = _timed(device, lambda: stock.generate_batch(inputs=inputs, generation_config=cfg))
            tokens = sum(len(r.generated_tokens) for r in out.values())
            rows.append(_row("transformers generate_batch", len(samples), tokens, ms))
        except Exception as exc:  # a peer's API or engine failing is reported, not fatal
            rows.append(dict(engine="transformers generate_batch", error=f"{type(exc).__name__}: {exc}"[:300]))
    if "compiled" in peers and device.type == "cuda":
        try:
            ids, mask = _left_padded(samples, device)
            ccfg = copy.deepcopy(cfg)
            ccfg.cache_implementation = "static"
            ccfg.compile_config = None
            torch.manual_seed(0)
            stock.generate(ids, attention_mask=mask, generation_config=ccfg)  # compile
            seq, ms = _timed(device, lambda: stock.generate(ids, attention_mask=mask, generation_config=ccfg))
            rows.append(_row("transformers compiled static generate", len(samples),
                             _kept(seq[:, ids.shape[1]:], eos), ms))
        except Exception as exc:
            rows.append(dict(engine="transformers compiled static generate", error=f"{type(exc).__name__}: {exc}"[:300]))
    return rows


# ---------------------------------------------------------------- the rollout's steps, one by one


@contextlib.contextmanager
def _timing_steps(device: torch.device, records: list[tuple]):
    """Within it, every decode step of a rollout appends (step batch b, rows in use, keys the
    rows in use attend to, start, end) to ``records``: CUDA events around the step's
    launch (or host clocks on the CPU). The keys of a row are its prompt and every token
    drawn so far, the one fed at this step included."""
    from ..integrations.hf import continuous_batching

    engine = continuous_batching._Rollout
    forward = engine._forward

    def mark():
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def timed(self, b: int):
        samples = self.row_sample[:b][self.row_sample[:b] >= 0]
        keys = int((self.length[samples] + self.drawn[samples]).sum())
        start = mark()
        out = forward(self, b)
        records.append((b, samples.size, keys, start, mark()))
        return out

    engine._forward = timed
    try:
        yield
    finally:
        engine._forward = forward


def phase_rows(model, prompts, n, max_new, eos, max_batch, device, bandwidth: float | None) -> list[dict[str, Any]]:
    """The rollout's decode steps by step batch: how many, their median time, rows in use and
    (on CUDA) their floor (the weights and the keys of the rows in use, read once at
    ``bandwidth`` GB/s), and the group's total time over its total floor; then all the steps
    together."""
    call = _warm_rollout(model, prompts, n, max_new, eos, max_batch)
    _release(device)
    records: list[tuple] = []
    with _timing_steps(device, records):
        call()
    _sync(device)
    release_decode_graphs(model)
    _release(device)
    params, kv_per_token = step_bytes(model)
    steps = []
    for b, rows, keys, start, end in records:
        ms = start.elapsed_time(end) if device.type == "cuda" else (end - start) * 1e3
        floor = (params + keys * kv_per_token) / (bandwidth * 1e9) * 1e3 if bandwidth else None
        steps.append((b, rows, ms, floor))
    out = []
    for b in sorted({s[0] for s in steps}) + [None]:
        group = [s for s in steps if b is None or s[0] == b]
        total = sum(s[2] for s in group)
        row = dict(engine="rollout steps" if b is None else "rollout step", batch=b, steps=len(group),
                   rows_in_use=statistics.median(s[1] for s in group), step_ms=round(statistics.median(
                       s[2] for s in group), 4), total_ms=round(total, 2))
        if bandwidth:
            floor = sum(s[3] for s in group)
            row.update(floor_ms=round(statistics.median(s[3] for s in group), 4), total_floor_ms=round(floor, 2),
                       floor_ratio=round(total / floor, 3))
        out.append(row)
    return out


def kernel_rows(model, prompts, n, max_new, eos, max_batch, device, top: int) -> list[dict[str, Any]]:
    """Where one rollout's device time goes: its ``top`` kernels by total device time
    (torch.profiler, after a call that compiles and captures; graph replays included), each
    with its launches and share of all kernel time, then one row of the total. On the CPU
    the operators' self time stands in for kernels."""
    from torch.profiler import ProfilerActivity, profile

    call = _warm_rollout(model, prompts, n, max_new, eos, max_batch)
    _release(device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        call()
        _sync(device)
    release_decode_graphs(model)
    _release(device)
    spent = [(e.key, e.count, e.self_device_time_total if cuda else e.self_cpu_time_total)
             for e in prof.key_averages()]
    spent = sorted((k for k in spent if k[2] > 0), key=lambda k: -k[2])
    total_us = sum(us for _, _, us in spent)
    rows = [dict(engine="rollout kernel", kernel=name, launches=count, total_ms=round(us / 1e3, 3),
                 share=round(us / total_us, 4)) for name, count, us in spent[:top]]
    rows.append(dict(engine="rollout kernels", kernel=None, launches=sum(c for _, c, _ in spent),
                     total_ms=round(total_us / 1e3, 3), share=1.0))
    return rows


# ---------------------------------------------------------------- the decode step


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Device-to-device copy bandwidth (bytes read + written), GB/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3) / 1e9


def _launches_per_layer(model: nn.Module, device: torch.device) -> float:
    """Kernels of one eager decode step (1 new token after an 8-token prompt: the profile of
    a 2-token generate less a 1-token one) per decoder layer."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.full((4, 8), 5, dtype=torch.long, device=device)

    def kernels(new: int) -> int:
        rlk_generate(model, ids, max_new_tokens=new, do_sample=False)
        _sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rlk_generate(model, ids, max_new_tokens=new, do_sample=False)
            _sync(device)
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")

    return (kernels(3) - kernels(2)) / model.config.num_hidden_layers


def step_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the model's parameters, bytes of keys and values per cached token): what a
    decode step reads once, and per key of each row's context."""
    cfg = model.config
    params = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * getattr(
        cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) * next(model.parameters()).element_size()
    return params, kv_per_token


def decode_floor_s(model: nn.Module, samples: list[tuple[int, int]], bandwidth: float,
                   prompts: list[int] | None = None) -> float:
    """The HBM floor of a rollout's decode steps, in seconds, for ``samples`` (prompt length
    L, new tokens l) each: the fewest steps any schedule takes (the longest sample's l - 1;
    the first token comes from the prefill), each reading the weights once, and every
    token t = 1 .. l - 1 reading its sample's L + t keys and values once, at ``bandwidth``
    GB/s. Prefills are left out. ``prompts`` (each sample's prompt): a prompt's L keys are
    read once per step for all its samples still decoding (the rollout's shared prompt
    reads), each sample's t keys of its own as before."""
    params, kv_per_token = step_bytes(model)
    steps = max((new - 1 for _, new in samples), default=0)
    keys = sum((new - 1) * L + new * (new - 1) // 2 for L, new in samples if new > 1)
    if prompts is not None:
        # A prompt's keys are read at each step t <= its longest sample's l - 1, not once per sample.
        longest: dict[int, tuple[int, int]] = {}
        for p, (L, new) in zip(prompts, samples):
            longest[p] = (L, max(new, longest.get(p, (L, 0))[1]))
        keys -= sum((new - 1) * L for L, new in samples if new > 1)
        keys += sum((new - 1) * L for L, new in longest.values() if new > 1)
    return (steps * params + keys * kv_per_token) / (bandwidth * 1e9)


def step_rows(model: nn.Module, batches: tuple[int, ...], device: torch.device, vocab: int) -> list[dict[str, Any]]:
    bandwidth = copy_bandwidth_gbs(device)
    params, kv_per_token = step_bytes(model)
    per_layer = _launches_per_layer(model, device)
    rows = []
    for batch in batches:
        prompt = 512
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(device)
        def call(new):
            return rlk_generate(model, ids, max_new_tokens=new, do_sample=False, cuda_graph=True,
                                cache_len=prompt + 160)

        # Both lengths once before any timing: a kept state's later calls take paths (and
        # compile kernels) the first call does not, and a compile inside one timed call
        # would swing the difference by seconds.
        for new in (32, 160):
            call(new)
        times: dict[int, list[float]] = {32: [], 160: []}
        for _ in range(STEP_REPS):
            for new in (32, 160):
                times[new].append(_timed(device, lambda: call(new))[1])
        release_decode_graphs(model)
        step_ms = (statistics.median(times[160]) - statistics.median(times[32])) / 128
        kv = kv_per_token * batch * (prompt + 96)  # the mean context over the 128 steps
        floor_ms = (params + kv) / (bandwidth * 1e9) * 1e3
        rows.append(dict(engine="decode step", batch=batch, prompt=prompt, step_ms=round(step_ms, 4),
                         floor_ms=round(floor_ms, 4), floor_ratio=round(step_ms / floor_ms, 3),
                         launches_per_layer=round(per_layer, 1)))
        gc.collect()
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = device.type == "cpu"
    name = args.config or ("tiny" if cpu else "qwen3-1.7b")
    prompts_n = args.prompts or (6 if cpu or args.quick else 64)
    lo, hi = args.prompt_lens or ((4, 24) if cpu else (64, 512))
    max_new = args.max_new or (24 if cpu else (128 if args.quick else 512))
    mean_len = args.mean_len or (8 if cpu else (60 if args.quick else 240))
    dtype = torch.float32 if cpu else torch.bfloat16
    config = whole.model_config(name, args.layers)
    stock, patched = whole.build_models(config, device, dtype)
    vocab = config.vocab_size
    eos = 1
    g = torch.Generator().manual_seed(whole.SEED)
    lengths = torch.randint(lo, hi + 1, (prompts_n,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).to(device) for n in lengths]
    scale = scale_eos_row([patched, stock], prompts[:16], eos, mean_len, max_new)
    bandwidth = None if cpu else copy_bandwidth_gbs(device)
    _release(device)  # the copy's buffers: max_batch=None sizes the cache by the free memory
    rows = [_rollout_row(patched, prompts, args.n, max_new, eos, args.max_batch, device, bandwidth=bandwidth),
            _generate_row(patched, prompts, args.n, max_new, eos, device)]
    rows += [_rollout_row(patched, prompts, args.n, max_new, eos, args.max_batch, device, spacing)
             for spacing in args.step_spacing]
    if args.own_prompt_reads:
        rows.append(_rollout_row(patched, prompts, args.n, max_new, eos, args.max_batch, device, bandwidth=bandwidth,
                                 shared_reads=False))
    if args.phases:
        rows += phase_rows(patched, prompts, args.n, max_new, eos, args.max_batch, device, bandwidth)
    if args.kernels:
        rows += kernel_rows(patched, prompts, args.n, max_new, eos, args.max_batch, device, args.kernels)
    if args.peers:
        rows += _peer_rows(stock, prompts[: args.peer_prompts], args.n, max_new, eos, device, args.peers)
    if not cpu and args.step_batches:
        rows += step_rows(patched, args.step_batches, device, vocab)
    base = rows[0]["tok_per_s"]
    for r in rows:
        if "tok_per_s" in r:
            r["rollout_speedup"] = round(base / r["tok_per_s"], 2)
    print_table(f"rollout: {prompts_n} prompts x {args.n}, lengths {lo}-{hi}, <= {max_new} new, mean ~{mean_len} "
                f"({name}, {device})", [r for r in rows if "tok_per_s" in r or "error" in r],
                ["engine", "samples", "new_tokens", "wall_s", "tok_per_s", "rollout_speedup", "decode_floor_s",
                 "floor_ratio", "shared_floor_s", "error"])
    phases = [r for r in rows if r["engine"] in ("rollout step", "rollout steps")]
    if phases:
        print_table("the rollout's decode steps by step batch (the last row: all of them)", phases,
                    ["batch", "steps", "rows_in_use", "step_ms", "floor_ms", "total_ms", "total_floor_ms",
                     "floor_ratio"])
    kernels = [r for r in rows if r["engine"] in ("rollout kernel", "rollout kernels")]
    if kernels:
        print_table("the rollout's device time by kernel (the last row: every kernel)", kernels,
                    ["kernel", "launches", "total_ms", "share"])
    steps = [r for r in rows if r["engine"] == "decode step"]
    if steps:
        print_table("decode step vs the HBM floor", steps,
                    ["batch", "prompt", "step_ms", "floor_ms", "floor_ratio", "launches_per_layer"])
    write_json(args.json, "rollout", rows, dict(config=name, eos_token_id=eos, eos_logit=scale,
                                                mean_len_target=mean_len, prompts=prompts_n, n=args.n,
                                                prompt_lens=[lo, hi], max_new_tokens=max_new))
    return rows
