"""A static-cache decode loop for a patched Hugging Face causal LM, replayed as a CUDA graph.

Rollout engines decode through CUDA graphs: one decode step is dozens of small
kernels per layer, and launching them from Python costs more than running them.
This loop keeps every input of a decode step in a fixed buffer (token ids, position
ids, the padding mask over the whole cache, a ``StaticCache`` whose write position
is a device counter), so the step -- decoder, final norm and LM head -- can be
captured once with ``torch.cuda.graph`` and replayed for every new token.

Replaying changes no bit: a graph replays the launches it recorded, and the patched
model's step is the same computation whatever the key length (a ``StaticCache``
hands the attention all ``L + max_new_tokens`` slots; the slots past a row's end are
masked out of the fixed chain, so the eager step and the replayed one agree). The
draw is in the graph too: :func:`rlkernels.linear_sample` keys its noise by the seed,
the row's stream and the token's position, which live in fixed buffers. The prompt
is prefilled eagerly, and the first decode step runs eagerly too: it compiles every
kernel and does every one-time host query before the capture.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..ops.linear_sample import linear_sample

OP = "generate"

# What the loop knows how to do; anything else in generate_kwargs is refused.
SUPPORTED_OPTIONS = frozenset({"max_new_tokens", "do_sample", "pad_token_id", "eos_token_id"})


class _StepBuffers:
    """The fixed inputs of one decode step (B rows; the mask spans the whole cache)."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> None:
        self.ids = ids              # [B, 1] long: the token fed to this step
        self.mask = mask            # [B, L + T] long: 1 for every real key written so far
        self.positions = positions  # [B, 1] long: the position of the fed token


def _takes_cache_position(decoder: nn.Module) -> bool:
    return "cache_position" in inspect.signature(type(decoder).forward).parameters


def static_generate(model: nn.Module, decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                    max_new_tokens: int, greedy: bool = True, temperature: float = 1.0, seed: int = 0,
                    streams: torch.Tensor | None = None, pad_token_id: int | None = None,
                    eos_token_ids: list[int] | tuple[int, ...] = (), cuda_graph: bool = True,
                    cache_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode up to ``max_new_tokens`` tokens after left-padded prompts with a ``StaticCache``.

    input_ids, attention_mask: [B, L] (long; left padding). ``decoder`` is the model's base
    decoder (returns the final, normed hidden states); ``cache_kwargs(decoder, cache)`` gives
    the cache keyword its forward takes. Each token is :func:`rlkernels.linear_sample` of the
    final hidden state that precedes it: the argmax of the fp32 logits / T (``greedy``), or a
    draw keyed by (``seed``, the row's stream, the token's position counted from the row's
    first real token), so left padding and batch-mates change nothing. ``streams``: int64
    [B] (None: ``arange(B)``). Returns ``(sequences [B, L + T], logp [B, T], entropy [B, T])``:
    the prompts followed by the new tokens (``pad_token_id`` after a row's EOS, with log-prob
    and entropy 0), and each new token's log-prob and entropy at T, bitwise
    ``linear_logprob``'s. T < ``max_new_tokens`` only where every row has ended.
    ``cuda_graph``: replay steps 2.. from one captured graph (CUDA only); False runs every
    step eagerly (the same loop, for CPUs and for comparison).
    """
    from transformers import StaticCache  # transformers is the optional "hf" extra

    B, L = input_ids.shape
    dev = input_ids.device
    head = model.get_output_embeddings()
    streams = torch.arange(B, device=dev) if streams is None else streams
    mask_long = attention_mask.long()
    total = L + max_new_tokens
    cache = StaticCache(config=model.config, max_cache_len=total)
    buffers = _StepBuffers(ids=torch.zeros(B, 1, dtype=torch.long, device=dev),
                           mask=torch.zeros(B, total, dtype=torch.long, device=dev),
                           positions=torch.zeros(B, 1, dtype=torch.long, device=dev))
    buffers.mask[:, :L] = mask_long

    # transformers 4.x writes a static cache at the slots ``cache_position`` names; 5.x
    # counts the writes on the device itself and takes no such argument.
    slots = {"cache_position": torch.arange(L, device=dev)} if _takes_cache_position(decoder) else {}

    def forward(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
        out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                      **cache_kwargs(decoder, cache), **slots)
        hidden = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[:, -1]
        # The token drawn here is the row's next one: its position follows the last fed token's.
        return linear_sample(hidden, head.weight, getattr(head, "bias", None), temperature=temperature,
                             seed=seed, streams=streams, positions=positions[:, -1] + 1, greedy=greedy,
                             return_entropy=True)

    def step():
        return forward(buffers.ids, buffers.mask, buffers.positions)

    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=dev) if eos_token_ids else None
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos is not None else 0)
    unfinished = torch.ones(B, dtype=torch.bool, device=dev)
    next_position = mask_long.sum(dim=1, keepdim=True)  # each row's real tokens so far

    with torch.no_grad():
        # Prefill: the prompt's keys fill slots [0, L); the mask's later slots are still 0.
        drawn = forward(input_ids, buffers.mask, (mask_long.cumsum(-1) - 1).clamp(min=0))
        graph: torch.cuda.CUDAGraph | None = None
        graph_out = None
        new_tokens: list[torch.Tensor] = []
        logps: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        for t in range(max_new_tokens):
            token, logp, ent = drawn
            zero = torch.zeros((), dtype=logp.dtype, device=dev)
            new_tokens.append(torch.where(unfinished, token, torch.full_like(token, pad)))
            logps.append(torch.where(unfinished, logp, zero))
            entropies.append(torch.where(unfinished, ent, zero))
            if eos is not None:
                unfinished &= ~torch.isin(token, eos)
                if not bool(unfinished.any()):
                    break
            if t + 1 == max_new_tokens:
                break
            # The token just drawn is the next step's input, written into slot L + t.
            buffers.ids.copy_(new_tokens[-1][:, None])
            buffers.positions.copy_(next_position)
            buffers.mask[:, L + t] = 1
            if slots:
                if t == 0:  # from here on one fixed buffer, the slot the step writes
                    slots["cache_position"] = torch.full((1,), L, dtype=torch.long, device=dev)
                else:
                    slots["cache_position"].fill_(L + t)
            next_position += 1
            if graph is not None:
                graph.replay()
                drawn = tuple(x.clone() for x in graph_out)
            else:
                drawn = step()
                if cuda_graph and t + 2 < max_new_tokens:
                    # The eager step compiled every kernel and made every one-time host query;
                    # record the next one (recording runs nothing: the cache's write counter
                    # advances only when the graph replays).
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        graph_out = step()
    sequences = torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)
    return sequences, torch.stack(logps, dim=1), torch.stack(entropies, dim=1)
