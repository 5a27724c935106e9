"""Tiny random Hugging Face causal LMs built from configs (no download), for this package's tests."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=True)


def _tiny(arch: str, dtype=torch.float32, device="cpu", **over):
    cfg = dict(TINY, **over)
    torch.manual_seed(0)
    if arch in ("qwen3", "qwen3_moe"):
        cfg.setdefault("head_dim", 8 if cfg["hidden_size"] == 32 else 64)
        if arch == "qwen3":
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
        else:
            model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg))
    elif arch == "mistral":  # MistralConfig's own sliding_window (4096) unless given
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**cfg))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    return model.to(device=device, dtype=dtype).eval()


def _same_training_gradients(model, twin, seed: int = 1) -> bool:
    """Whether one training step's backward (token log-probs of a random [2, 7] batch, summed)
    gives ``model`` and ``twin`` bitwise equal parameter gradients."""
    import rlkernels

    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(seed))
    grads = []
    for m in (model, twin):
        m.train()
        rlkernels.token_logprobs(m, ids).sum().backward()
        grads.append([p.grad for p in m.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def llama_subclass(base: str, source: str, tmp_path, name: str) -> type:
    """A subclass ``name`` of the Llama modeling module's class ``base`` whose forward is
    ``source`` (written to a file, so that ``inspect.getsource`` reads it as it reads
    transformers' own)."""
    path = tmp_path / f"{name}.py"
    path.write_text(f"from transformers.models.llama.modeling_llama import {base}\n\n"
                    f"class {name}({base}):\n" + "".join(f"    {line}\n" for line in source.splitlines()))
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace[name]
