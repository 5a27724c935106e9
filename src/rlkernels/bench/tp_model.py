"""The whole-model part of ``rlkernels bench tp``: a patched Qwen3 sharded by
:func:`rlkernels.tensor_parallel` at each TP size, against the one-GPU models.

Run inside the suite's rank processes (:mod:`rlkernels.bench.tp`). Per TP size, on the
ranks of that size's group:

- ``score``: ``token_logprobs`` of a [rows, tokens] batch without gradients
  (``rlkernels_linear_ms`` at TP = 1: the patched model without the TP layout);
  stock = the unpatched model's forward and ``log_softmax`` (TP = 1), and transformers'
  own ``tp_plan="auto"`` at the largest TP size where it loads;
- ``decode step``: an eager sampled ``generate`` at batch B; the step is the time
  difference of a long and a short generation divided by the extra tokens (prefill and
  set-up cancel); stock = the unpatched model's ``generate`` the same way.

``bitwise_tp1`` says whether the scores equal the ``group=None`` layout's (the contract).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

GPU_MODEL = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                 tie_word_embeddings=True)
CPU_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True)
GPU_WORK = dict(score=(4, 1024), batch=64, prompt=128, new=(8, 40))
CPU_WORK = dict(score=(2, 64), batch=4, prompt=16, new=(2, 6))
TEMPERATURE = 0.7
REPS = 3


def _config(cuda: bool):
    import transformers

    return transformers.Qwen3Config(**(GPU_MODEL if cuda else CPU_MODEL))


def _build(config, device: torch.device, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)  # every rank draws the same weights
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config)
    model = model.to(dtype).eval()
    with torch.no_grad():  # a trained head's logit scale
        model.get_output_embeddings().weight.mul_(7.0)
    return model


def progress(rank: int, what: str) -> None:
    """One line on rank 0's stderr: where a long distributed run is."""
    if rank == 0:
        print(f"[bench tp {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def _wall_ms(fn: Callable[[], Any], cuda: bool) -> float:
    """Median wall time of ``REPS`` calls after one warm-up (generate syncs on the host)."""
    fn()
    times = []
    for _ in range(REPS):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _stock_score(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def _step_ms(generate: Callable[[int], Any], new: tuple[int, int], cuda: bool) -> float:
    short, long = (_wall_ms(lambda n=n: generate(n), cuda) for n in new)
    return (long - short) / (new[1] - new[0])


def model_rows(rank: int, sizes: list[int], groups: dict[int, dist.ProcessGroup], device: torch.device,
               folder: str) -> list[dict]:
    """Rank 0's rows of the whole-model comparison (every rank makes the same calls)."""
    import rlkernels

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config, work = _config(cuda), (GPU_WORK if cuda else CPU_WORK)
    gen = torch.Generator().manual_seed(11)
    rows_n, tokens = work["score"]
    ids = torch.randint(0, config.vocab_size, (rows_n, tokens), generator=gen).to(device)
    prompts = torch.randint(0, config.vocab_size, (work["batch"], work["prompt"]), generator=gen).to(device)
    streams = torch.arange(work["batch"], device=device)
    rows: list[dict] = []
    ref = None

    def ours_generate(model) -> Callable[[int], Any]:
        return lambda n: rlkernels.generate(model, prompts, max_new_tokens=n, do_sample=True, temperature=TEMPERATURE,
                                            seed=1, streams=streams, eos_token_id=[], cuda_graph=False)

    for tp in sizes:
        group = groups.get(tp)
        progress(rank, f"model, TP = {tp}")
        if rank < tp:
            model = rlkernels.tensor_parallel(rlkernels.patch_model(_build(config, device, dtype)), group)
            with torch.no_grad():
                score = _wall_ms(lambda: rlkernels.token_logprobs(model, ids, temperature=TEMPERATURE), cuda)
                lp = rlkernels.token_logprobs(model, ids, temperature=TEMPERATURE).cpu()
                step = _step_ms(ours_generate(model), work["new"], cuda)
            del model
            same = True if tp == 1 else (torch.equal(lp.view(torch.int32), ref.view(torch.int32)) if rank == 0
                                         else None)
            ref = lp if tp == 1 else ref
            stock: dict[str, float | None] = {"score": None, "step": None}
            plain: dict[str, float | None] = {"score": None, "step": None}
            note = ("stock: the unpatched model on one process" if tp == 1 else
                    "stock: transformers' tp_plan='auto'" if tp == sizes[-1] else "no stock TP at this size")
            if tp == 1:
                stock = _stock_times(_build(config, device, dtype), ids, prompts, work["new"], cuda)
                patched = rlkernels.patch_model(_build(config, device, dtype))
                with torch.no_grad():
                    plain = {"score": _wall_ms(lambda: rlkernels.token_logprobs(patched, ids, temperature=TEMPERATURE),
                                               cuda),
                             "step": _step_ms(ours_generate(patched), work["new"], cuda)}
                del patched
            elif tp == sizes[-1]:
                stock, note = _stock_tp(config, dtype, ids, prompts, work["new"], device, folder, rank, tp, note)
            if cuda:
                torch.cuda.empty_cache()
            name = "qwen3 (1.7B shape)" if cuda else "qwen3 (tiny)"
            for what, ours, key in (("score", score, "score"), ("decode step", step, "step")):
                theirs = stock[key]
                rows.append({"layer": f"{name} {what}", "tp": tp, "pass": "fwd", "stock_ms": theirs,
                             "rlkernels_linear_ms": plain[key], "rlkernels_ms": ours,
                             "ratio": ours / theirs if theirs else None, "bitwise_tp1": same, "note": note})
        dist.barrier()
    return rows


def _stock_times(model, ids: torch.Tensor, prompts: torch.Tensor, new: tuple[int, int], cuda: bool) -> dict:
    """A stock model's score and decode-step times (ms)."""
    with torch.no_grad():
        return {"score": _wall_ms(lambda: _stock_score(model, ids), cuda),
                "step": _step_ms(lambda n: model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                                          max_new_tokens=n, min_new_tokens=n, do_sample=True,
                                                          temperature=TEMPERATURE, top_k=0, top_p=1.0,
                                                          pad_token_id=0), new, cuda)}


def _stock_tp(config, dtype: torch.dtype, ids: torch.Tensor, prompts: torch.Tensor, new: tuple[int, int],
              device: torch.device, folder: str, rank: int, tp: int, note: str) -> tuple[dict, str]:
    """transformers' own tensor parallelism over the whole world: the model saved by rank 0,
    loaded with ``tp_plan="auto"`` on every rank; its times, or none and a note saying why."""
    import transformers

    path = os.path.join(folder, "stock_checkpoint")
    for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", tp)):
        os.environ.setdefault(key, str(value))  # what transformers' TP loader reads
    if rank == 0:
        _build(config, device, dtype).save_pretrained(path)
    dist.barrier()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype).eval()
        return _stock_times(model, ids, prompts, new, device.type == "cuda"), note
    except Exception as e:  # a peer that does not run here is reported, not fatal
        return ({"score": None, "step": None},
                f"tp_plan='auto' did not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
