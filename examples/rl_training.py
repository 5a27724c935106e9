"""A GRPO-style RL loop on an rlkernels-patched policy (walked through in docs/guide/rl_training.md).

    python examples/rl_training.py                 # tiny random Qwen3, CPU, a few seconds
    python examples/rl_training.py --device cuda --dtype bfloat16

Each step: roll out groups of completions with ``rlkernels.generate``; score them
with ``rlkernels.token_logprobs`` (log-probs and entropy at the sampling temperature);
compute group-normalized advantages and the clipped-ratio loss; backward in
micro-batches into ``main_grad``; one optimizer step. The asserts are the point of
the example: the first update's ratio is exactly 1.0 for every token (old log-probs
scored one sequence at a time, new ones in one batch), and the micro-batched
gradients equal the one-batch gradients bit for bit.
"""
from __future__ import annotations

import argparse

import torch
import transformers

import rlkernels

PAD, BOS, EOS = 0, 1, 2


def build_policy(device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight Qwen3 from a config (no download), patched by rlkernels."""
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        # Untied: the lm head's dW goes to main_grad while an embedding's goes to .grad,
        # so a tied weight would have its gradient in two places.
        tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()
    # rlkernels.Linear for every nn.Linear (lm head included), rlkernels RMSNorm, the "rlkernels" attention.
    return rlkernels.patch_model(model)


def attach_main_grad(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """fp32 ``main_grad`` buffers on every rlkernels.Linear parameter (Megatron's convention).

    rlkernels.Linear and linear_logprob (the lm head inside token_logprobs) accumulate
    dW into ``main_grad`` inside the GEMM's fp32 chain; other parameters (embedding,
    norms) keep using ``.grad``.
    """
    params = []
    for module in model.modules():
        if isinstance(module, rlkernels.Linear):
            for p in module.parameters(recurse=False):
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                params.append(p)
    return params


def rollout(model, prompts: list[list[int]], group: int, max_new_tokens: int, temperature: float, seed: int):
    """Sample ``group`` completions per prompt. Returns (sequences, attention_mask, response_mask, P).

    sequences [B, L] = left-padded prompts (width P) + completions; attention_mask marks
    real tokens (completion tokens after the first EOS are padding); response_mask
    [B, L-1] marks the log-prob positions that score a completion token.
    """
    rows = [p for p in prompts for _ in range(group)]
    P = max(len(p) for p in rows)
    dev = next(model.parameters()).device
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in rows], device=dev)
    prompt_mask = (torch.arange(P, device=dev)[None, :] >= torch.tensor([P - len(p) for p in rows],
                                                                        device=dev)[:, None]).long()
    with torch.no_grad():
        # rlkernels.generate draws each token from softmax(fp32 logits / T), the distribution
        # token_logprobs(temperature=T) scores, and returns that token's log-prob by the
        # trainer's formula. Draws are keyed by (seed, stream, position): a row's
        # completion is reproducible from its stream alone, whatever its batch-mates.
        seqs, sampler_logp = rlkernels.generate(model, ids, prompt_mask, do_sample=True, temperature=temperature,
                                                max_new_tokens=max_new_tokens, pad_token_id=PAD, eos_token_id=EOS,
                                                seed=seed, streams=torch.arange(len(rows), device=dev))
    completion = seqs[:, P:]
    # Keep tokens up to and including the first EOS.
    after_eos = (completion == EOS).long().cumsum(-1) - (completion == EOS).long()
    completion_mask = (after_eos == 0).long()
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    response_mask = torch.zeros(seqs.shape[0], seqs.shape[1] - 1, dtype=torch.bool, device=dev)
    response_mask[:, P - 1:] = completion_mask.bool()  # position t scores token t+1
    old_logp = torch.zeros(seqs.shape[0], seqs.shape[1] - 1, dtype=torch.float32, device=dev)
    old_logp[:, P - 1:] = sampler_logp * completion_mask  # the sampler's log-probs, at the trainer's positions
    return seqs, mask, response_mask, P, old_logp


def reward(seqs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A toy verifiable reward: the fraction of completion tokens with an even id."""
    tokens = seqs[:, 1:]
    even = ((tokens % 2 == 0) & response_mask).sum(-1).float()
    return even / response_mask.sum(-1).clamp(min=1).float()


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's standard deviation."""
    r = rewards.view(-1, group)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + eps)).view(-1)


def token_weights(response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token loss weights: mean over each response's tokens, then over responses.

    Computed once for the whole batch, so a micro-batch's loss is the sum of its own
    tokens' terms and the micro-batches add up to the full loss term for term.
    """
    lengths = response_mask.sum(-1, keepdim=True).clamp(min=1)
    return response_mask.float() / (lengths * response_mask.shape[0])


def score_one_at_a_time(model, seqs, mask, temperature: float) -> torch.Tensor:
    """token_logprobs of each sequence alone, its left padding cut off: [B, L-1]."""
    out = torch.zeros(seqs.shape[0], seqs.shape[1] - 1, dtype=torch.float32, device=seqs.device)
    with torch.no_grad():
        for i in range(seqs.shape[0]):
            start = int(mask[i].nonzero()[0, 0])
            out[i, start:] = rlkernels.token_logprobs(model, seqs[i:i + 1, start:], mask[i:i + 1, start:],
                                                      temperature=temperature)[0]
    return out


def grpo_loss(logp, old_logp, advantages, weights, *, entropy=None, clip_eps: float = 0.2,
              entropy_coef: float = 0.0) -> torch.Tensor:
    """Clipped-ratio policy loss, summed with per-token ``weights`` (see token_weights)."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    return (per_token * weights).sum()


def backward(model, seqs, mask, old_logp, advantages, weights, temperature: float, micro: int) -> torch.Tensor:
    """Forward + backward in micro-batches of ``micro`` sequences; returns the summed loss.

    The whole step runs under the batch-invariant mode, so the backward's stock ops
    (elementwise and reduction ops outside the patched modules) are the invariant ones too.
    """
    total = torch.zeros((), device=seqs.device)
    with rlkernels.set_batch_invariant_mode(True):
        for s in range(0, seqs.shape[0], micro):
            sl = slice(s, s + micro)
            logp, entropy = rlkernels.token_logprobs(model, seqs[sl], mask[sl], temperature=temperature,
                                                     return_entropy=True)
            loss = grpo_loss(logp, old_logp[sl], advantages[sl], weights[sl], entropy=entropy, entropy_coef=1e-3)
            loss.backward()
            total += loss.detach()
    return total


def zero_grads(model, main_grad_params) -> None:
    model.zero_grad(set_to_none=True)
    for p in main_grad_params:
        p.main_grad.zero_()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="torch intra-op threads on the CPU while the example runs (0: torch's own setting)")
    args = ap.parse_args(argv)
    # One thread on the CPU, as `rlkernels check` scores: the tiny model's ops are too small
    # to gain from threads, and on a busy machine each threaded op waits on descheduled
    # OpenMP workers (measured on 2 loaded cores: 22 s threaded, 8 s on one thread). The
    # bits do not depend on the thread count.
    previous_threads = torch.get_num_threads()
    if torch.device(args.device).type == "cpu" and args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    try:
        return train(args)
    finally:
        torch.set_num_threads(previous_threads)


def train(args: argparse.Namespace) -> dict:
    """The RL loop of :func:`main` with its parsed arguments; returns the last step's summary."""
    dtype = getattr(torch, args.dtype)
    T = args.temperature

    model = build_policy(args.device, dtype)
    main_grad_params = attach_main_grad(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prompts = [[BOS, 17, 42, 99, 7], [BOS, 250, 3]]
    summary = {}
    for step in range(args.steps):
        seqs, mask, response_mask, _, sampler_old = rollout(model, prompts, args.group, args.max_new_tokens, T,
                                                            seed=1000 + step)
        adv = group_advantages(reward(seqs, response_mask), args.group)
        weights = token_weights(response_mask)

        # Old log-probs: the sampler-side scores of the finished rollouts, one sequence at a time.
        old = score_one_at_a_time(model, seqs, mask, T)
        # New log-probs, before the update: the same sequences in one padded batch.
        with torch.no_grad():
            new, entropy = rlkernels.token_logprobs(model, seqs, mask, temperature=T, return_entropy=True)
        assert torch.equal(new, old), "old and new log-probs differ before any update"
        # ... and the sampler's own log-probs from the rollout are those bits too.
        assert torch.equal(new[response_mask], sampler_old[response_mask]), "sampler and trainer log-probs differ"
        ratio = torch.exp(new - old)[response_mask]
        assert torch.equal(ratio, torch.ones_like(ratio)), "first-step ratio is not exactly 1"

        # The gradient of the whole batch at once, then in micro-batches: the same bits.
        zero_grads(model, main_grad_params)
        backward(model, seqs, mask, old, adv, weights, T, micro=seqs.shape[0])
        full = [p.main_grad.clone() for p in main_grad_params]
        zero_grads(model, main_grad_params)
        loss = backward(model, seqs, mask, old, adv, weights, T, micro=args.micro)
        same = all(torch.equal(a, p.main_grad) for a, p in zip(full, main_grad_params))
        tokens = [args.micro * (seqs.shape[1] - 1), args.micro * seqs.shape[1]]  # lm head, decoder layers
        on_token_blocks = all(n % rlkernels.TOKEN_BLOCK == 0 for n in tokens)
        if seqs.device.type == "cpu" or dtype == torch.float32 or on_token_blocks:
            # CPU and the fp32 chain are exact at any split; 16-bit GPU chains at TOKEN_BLOCK splits.
            assert same, "micro-batched main_grad differs from the one-batch main_grad"

        for p in main_grad_params:  # hand the accumulated fp32 gradient to the optimizer
            p.grad = p.main_grad.to(p.dtype)
        optim.step()
        with torch.no_grad():
            after = rlkernels.token_logprobs(model, seqs, mask, temperature=T)
        moved = torch.exp(after - old)[response_mask]
        summary = dict(step=step, loss=float(loss),
                       reward=float(reward(seqs, response_mask).mean()),
                       mean_entropy=float(entropy[response_mask].mean()),
                       ratio_first_update=(float(ratio.min()), float(ratio.max())),
                       ratio_after_update=(float(moved.min()), float(moved.max())),
                       microbatch_grads_bitwise=same, tokens_per_microbatch=tokens)
        print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return summary


if __name__ == "__main__":
    main()
