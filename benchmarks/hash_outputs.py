"""Hash the outputs of every public op on fixed inputs, to prove a change moved no bit.

    PYTHONPATH=<tree>/src python benchmarks/hash_outputs.py [--only dense,moe,attention,model] --json $OUT/hashes_<tree>.json
    python benchmarks/hash_outputs.py --compare baseline.json new.json

Only the public API is called, so two trees with different internal layouts can be
compared. Each case hashes the forward output and, where the op is differentiable,
the gradients (one line per case; the JSON maps case -> sha256 of the raw bytes).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch


def _digest(*tensors: torch.Tensor | None) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().contiguous().cpu()
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _rand(*shape, dtype, seed, scale=1.0, grad=False, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    t = (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)
    return t.requires_grad_(grad)


GROUPS = ("dense", "moe", "attention", "model")


def cases(device: str, groups: tuple[str, ...] = GROUPS) -> dict[str, str]:
    """{case: sha256} of the groups asked for: ``dense`` (linear, matmul, bmm, the head ops,
    norms, the mode), ``moe`` (the op pair), ``attention``, ``model`` (a patched model's scoring
    and decoding)."""
    out: dict[str, str] = {}
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if device == "cuda" else (torch.float32,)
    for dt in dtypes:
        if "dense" in groups:
            out.update(dense_cases(device, dt))
        if "moe" in groups:
            out.update(moe_cases(device, dt))
    if "attention" in groups:
        out.update(attention_cases(device))
    if "model" in groups:
        for dt in dtypes:
            out.update(model_cases(device, dt))
    return out


def dense_cases(device: str, dt: torch.dtype) -> dict[str, str]:
    import rlkernels

    out: dict[str, str] = {}
    name = str(dt).replace("torch.", "")
    for m, k, n in [(1, 4096, 4096), (7, 4096, 12288), (16, 4096, 151936), (33, 12288, 4096), (64, 1024, 3001),
                    (128, 4096, 4096), (300, 1000, 1032), (1031, 1024, 4096), (4099, 4096, 4096)]:
        if dt == torch.float32 and n == 151936 and m > 16:
            continue
        x = _rand(m, k, dtype=dt, seed=m + k, grad=True, device=device)
        w = _rand(n, k, dtype=dt, seed=n, scale=k ** -0.5, grad=True, device=device)
        b = _rand(n, dtype=dt, seed=1, grad=True, device=device)
        y = rlkernels.linear(x, w, b)
        y.float().square().mean().backward()
        out[f"linear {name} {m}x{k}x{n}"] = _digest(y, x.grad, w.grad, b.grad)
        if m <= 64:
            out[f"matmul [K,N] {name} {m}x{k}x{n}"] = _digest(rlkernels.matmul(x.detach(), w.detach().t().contiguous()))
    for bt, m, k, n in [(1024, 12, 64, 12), (7, 17, 33, 5), (3, 129, 257, 65)]:
        a = _rand(bt, m, k, dtype=dt, seed=bt, grad=True, device=device)
        bb = _rand(bt, k, n, dtype=dt, seed=k, grad=True, device=device)
        y = rlkernels.bmm(a, bb)
        y.float().sum().backward()
        out[f"bmm {name} {bt}x{m}x{k}x{n}"] = _digest(y, a.grad, bb.grad)
    for nn_, d, v in [(1, 4096, 151936), (257, 1024, 32003), (2048, 4096, 151936)]:
        if dt == torch.float32 and nn_ > 1:
            continue
        h = _rand(nn_, d, dtype=dt, seed=d, grad=True, device=device)
        w = _rand(v, d, dtype=dt, seed=v, scale=d ** -0.5, grad=True, device=device)
        t = torch.randint(0, v, (nn_,), generator=torch.Generator().manual_seed(3)).to(device)
        lp, ent = rlkernels.linear_logprob(h, w, t, temperature=0.8, return_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        out[f"linear_logprob {name} {nn_}x{d}x{v}"] = _digest(lp, ent, h.grad, w.grad)
        streams = torch.arange(nn_, device=device) * 7919 - 3
        positions = torch.arange(nn_, device=device) % 4099
        draws = rlkernels.linear_sample(h.detach(), w.detach() * 6, temperature=0.8, seed=11, streams=streams,
                                        positions=positions, return_entropy=True)
        greedy = rlkernels.linear_sample(h.detach(), w.detach() * 6, temperature=0.8, greedy=True)
        out[f"linear_sample {name} {nn_}x{d}x{v}"] = _digest(*draws, *greedy)
        # Truncated draws, and the trainer's log-prob (and gradients) under their thresholds.
        tok, tlp, tent, tau = rlkernels.linear_sample(h.detach(), w.detach() * 6, temperature=0.8, seed=11,
                                                      streams=streams, positions=positions, return_entropy=True,
                                                      top_k=50, top_p=0.9, return_threshold=True)
        h.grad = w.grad = None
        lp_t = rlkernels.linear_logprob(h, w * 6, tok, temperature=0.8, logit_threshold=tau)
        lp_t.sum().backward()
        out[f"linear_sample top_k top_p {name} {nn_}x{d}x{v}"] = _digest(tok, tlp, tent, tau, lp_t, h.grad, w.grad)
        # Gemma 2's final soft-cap (30, past a trained head's spread), truncated, and its trainer.
        cap = dict(temperature=0.8, logit_softcap=30.0, logit_scale=1.5)
        tok, tlp, tent, tau = rlkernels.linear_sample(h.detach(), w.detach() * 12, seed=11, streams=streams,
                                                      positions=positions, return_entropy=True, top_p=0.95,
                                                      return_threshold=True, **cap)
        h.grad = w.grad = None
        lp_c, ent_c = rlkernels.linear_logprob(h, w * 12, tok, logit_threshold=tau, return_entropy=True, **cap)
        (lp_c.sum() + 0.1 * ent_c.sum()).backward()
        out[f"linear_sample softcap top_p {name} {nn_}x{d}x{v}"] = _digest(tok, tlp, tent, tau, lp_c, ent_c, h.grad,
                                                                           w.grad)
    for rows, r in [(7, 1000), (4096, 2048), (33, 16385)]:
        x = _rand(rows, r, dtype=dt, seed=r, grad=True, device=device)
        wn = _rand(r, dtype=dt, seed=5, grad=True, device=device)
        y = rlkernels.rms_norm(x, wn)
        s = rlkernels.softmax(x, -1)
        ls = rlkernels.log_softmax(x, -1)
        (y.float().sum() + s.float().square().sum() + ls.float().sum()).backward()
        out[f"norms {name} {rows}x{r}"] = _digest(y, s, ls, x.grad, wn.grad)
    with rlkernels.set_batch_invariant_mode():
        x = _rand(13, 1000, dtype=dt, seed=7, grad=True, device=device)
        w = _rand(1000, 257, dtype=dt, seed=8, scale=0.03, grad=True, device=device)
        y = torch.softmax(x @ w, -1).mean(-1)
        y.float().sum().backward()
        out[f"mode {name}"] = _digest(y, x.grad, w.grad)
    return out


def moe_cases(device: str, dt: torch.dtype) -> dict[str, str]:
    """The MoE block's op pair at a small Qwen3-MoE-like shape: routing, the grouped expert
    GEMMs, the fp32 combine, and every gradient."""
    import rlkernels
    from rlkernels.ops.moe import moe_experts, moe_topk

    out: dict[str, str] = {}
    name = str(dt).replace("torch.", "")
    for tokens in (1, 257):
        x = _rand(tokens, 512, dtype=dt, seed=tokens, grad=True, device=device)
        router = _rand(32, 512, dtype=dt, seed=31, scale=512 ** -0.5, grad=True, device=device)
        gate_up = _rand(32, 2 * 192, 512, dtype=dt, seed=32, scale=512 ** -0.5, grad=True, device=device)
        down = _rand(32, 512, 192, dtype=dt, seed=33, scale=192 ** -0.5, grad=True, device=device)
        weights, ids = moe_topk(rlkernels.linear(x, router), 4)
        y = moe_experts(x, ids, weights, gate_up, down)
        y.float().sum().backward()
        out[f"moe {name} {tokens}x512 E32 k4 I192"] = _digest(y, ids, x.grad, router.grad, gate_up.grad, down.grad)
    return out


def attention_cases(device: str) -> dict[str, str]:
    """flash_attn_func forward + backward, the packed varlen call and KV-cache decode / chunked
    prefill (GQA 16/8 heads). CUDA runs the triton kernels; the CPU one tiny fp32 case."""
    import rlkernels

    out: dict[str, str] = {}
    if device == "cuda":
        dtypes, hq, hkv, head_dims, cap = (torch.bfloat16, torch.float16), 16, 8, (128, 64), 4096
        lens = (1, 100, 1024, 3000)
        packed = (700, 1, 1299)
        seqlens = (0, 1000, 2500, 4095)  # cache rows before this call: 1 to 4 splits of 1024 keys
    else:
        dtypes, hq, hkv, head_dims, cap = (torch.float32,), 2, 1, (16,), 40
        lens = (5,)
        packed = (5, 1, 7)
        seqlens = (0, 9, 30)
    for dt in dtypes:
        name = str(dt).replace("torch.", "")
        for d in head_dims:
            for L in lens:
                q = _rand(2, L, hq, d, dtype=dt, seed=L + d, grad=True, device=device)
                k = _rand(2, L, hkv, d, dtype=dt, seed=L + d + 1, grad=True, device=device)
                v = _rand(2, L, hkv, d, dtype=dt, seed=L + d + 2, grad=True, device=device)
                y = rlkernels.flash_attn_func(q, k, v, causal=True)
                y.backward(_rand(*y.shape, dtype=dt, seed=L + d + 3, device=device))
                out[f"flash_attn_func causal {name} 2x{L}x{hq}/{hkv}x{d}"] = _digest(y, q.grad, k.grad, v.grad)
            tq = sum(packed)
            cu = torch.tensor([0, packed[0], packed[0] + packed[1], tq], dtype=torch.int32, device=device)
            q = _rand(tq, hq, d, dtype=dt, seed=d + 4, grad=True, device=device)
            k = _rand(tq, hkv, d, dtype=dt, seed=d + 5, grad=True, device=device)
            v = _rand(tq, hkv, d, dtype=dt, seed=d + 6, grad=True, device=device)
            y = rlkernels.flash_attn_varlen_func(q, k, v, cu, cu, max(packed), max(packed), causal=True)
            y.backward(_rand(*y.shape, dtype=dt, seed=d + 7, device=device))
            out[f"flash_attn_varlen_func causal {name} {packed}x{hq}/{hkv}x{d}"] = _digest(y, q.grad, k.grad, v.grad)
            nb = len(seqlens)
            cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=device)
            for lq in (1, 20, 40):  # decode, and chunks that take the split (20 x 2 rows) or the full kernel
                lq_seqlens = cache_seqlens.clamp(max=cap - lq)  # the appended rows fit the cache
                kc = _rand(nb, cap, hkv, d, dtype=dt, seed=d + 8, device=device)
                vc = _rand(nb, cap, hkv, d, dtype=dt, seed=d + 9, device=device)
                q = _rand(nb, lq, hq, d, dtype=dt, seed=d + lq + 10, device=device)
                kn = _rand(nb, lq, hkv, d, dtype=dt, seed=d + lq + 11, device=device)
                vn = _rand(nb, lq, hkv, d, dtype=dt, seed=d + lq + 12, device=device)
                y = rlkernels.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lq_seqlens, causal=True)
                y2 = rlkernels.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lq_seqlens + lq, causal=True)
                out[f"flash_attn_with_kvcache {name} {nb}x{lq}x{hq}/{hkv}x{d} cache {cap}"] = _digest(y, y2, kc, vc)
    return out


def model_cases(device: str, dt: torch.dtype) -> dict[str, str]:
    """A patched Qwen3- and Llama-shaped model (4 layers, GQA 8/4 heads of 64, the LM head scaled
    to a trained model's logit spread): ``token_logprobs`` of a left-padded batch with its
    gradient, ``generate``'s sampled tokens and log-probs and ``rollout``'s, eager and (CUDA) graphed."""
    import rlkernels
    import transformers

    out: dict[str, str] = {}
    name = str(dt).replace("torch.", "")
    shape = dict(vocab_size=4099, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, pad_token_id=0)
    for arch, cls, config in (("qwen3", transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
                              ("llama", transformers.LlamaForCausalLM, transformers.LlamaConfig)):
        torch.manual_seed(0)
        extra = dict(head_dim=64) if arch == "qwen3" else {}
        model = cls(config(**shape, **extra, tie_word_embeddings=False)).to(device=device, dtype=dt).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(40.0)  # logit std ~5-8, as a trained head gives
        model.generation_config.eos_token_id = None
        rlkernels.patch_model(model)
        lens = (37, 5, 64, 1, 99)
        width = max(lens)
        g = torch.Generator().manual_seed(5)
        ids = torch.zeros(len(lens), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lens):
            ids[i, width - n:] = torch.randint(1, 4099, (n,), generator=g)
            mask[i, width - n:] = 1
        ids, mask = ids.to(device), mask.to(device)
        logp = rlkernels.token_logprobs(model, ids, mask)
        logp.sum().backward()
        grads = [p.grad for p in model.parameters()]
        out[f"model {arch} {name} token_logprobs"] = _digest(logp, *grads)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            runs = [("eager", False)] + ([("graphed", True)] if device == "cuda" else [])
            for how, graph in runs:
                seq, lp = rlkernels.generate(model, ids, mask, max_new_tokens=16, do_sample=True, seed=11,
                                             temperature=0.8, cuda_graph=graph)
                out[f"model {arch} {name} generate sampled {how}"] = _digest(seq, lp)
                seq, lp = rlkernels.generate(model, ids, mask, max_new_tokens=16, cuda_graph=graph)
                out[f"model {arch} {name} generate greedy {how}"] = _digest(seq, lp)
                seq, lp, tau = rlkernels.generate(model, ids, mask, max_new_tokens=16, do_sample=True, seed=11,
                                                  temperature=0.8, cuda_graph=graph, top_p=0.9,
                                                  return_thresholds=True)
                out[f"model {arch} {name} generate top_p {how}"] = _digest(seq, lp, tau)
                # Continuous batching: 10 samples through 3 slots, so rows are refilled mid-run.
                prompts = [ids[i, width - n:] for i, n in enumerate(lens)]
                samples = rlkernels.rollout(model, prompts, n=2, max_new_tokens=16, seed=11, temperature=0.8,
                                            max_batch=3, cuda_graph=graph)
                out[f"model {arch} {name} rollout sampled {how}"] = _digest(
                    torch.cat([r.tokens for r in samples]), torch.cat([r.logprobs for r in samples]))
        rlkernels.release_decode_graphs(model)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", default=",".join(GROUPS), help=f"groups of cases, any of {','.join(GROUPS)}")
    args = p.parse_args()
    groups = tuple(args.only.split(","))
    if not set(groups) <= set(GROUPS):
        p.error(f"--only: unknown group(s) {sorted(set(groups) - set(GROUPS))}; choose from {','.join(GROUPS)}")
    if args.compare:
        # A is the baseline: a case of A that B lacks fails the comparison (it was not checked);
        # a case only B has (a group the baseline predates) is listed, with nothing to compare it to.
        a, b = (json.load(open(f))["hashes"] for f in args.compare)
        differ = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
        missing, unbased = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
        print(f"{len(a.keys() & b.keys())} cases compared, {len(differ)} differ, {len(missing)} of the baseline "
              f"missing, {len(unbased)} without a baseline")
        for k in differ:
            print("DIFFERS", k)
        for k in missing:
            print("MISSING", k)
        for k in unbased:
            print("NO BASELINE", k)
        return 1 if differ or missing else 0
    hashes = cases(args.device, groups)
    for k, v in hashes.items():
        print(v[:16], k, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "torch": torch.__version__, "hashes": hashes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
