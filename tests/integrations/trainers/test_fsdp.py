"""A patched model under FSDP2 (``fully_shard``): training steps run-to-run bitwise, and each
rank's per-token log-probs equal the one-process model's bit for bit.

CPU: gloo, two processes, the tiny Qwen3 in fp32. GPU (marked ``gpu``, two CUDA devices):
NCCL, bf16, the check's wider model (hidden 1024, 4 layers). Without the library's FSDP2
hook (``integrations.trainers.fsdp``) ``token_logprobs`` raises on an FSDP2 model (the root's
parameters stay sharded DTensors).
"""
from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import rlkernels
from rlkernels.check.model import GPU_WIDTH, build_model

from ...parallel._workers import run_world

WORLD = 2
STEPS = 2
SEQS_PER_RANK = 3


def _batch(device: torch.device, vocab: int):
    """Every rank's right-padded sequences (rank r holds rows r*SEQS_PER_RANK ..) and advantages."""
    g = torch.Generator().manual_seed(11)
    n = WORLD * SEQS_PER_RANK
    lengths = torch.randint(5, 23, (n,), generator=g)
    ids = torch.randint(3, vocab, (n, int(lengths.max())), generator=g)
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    ids = ids * mask
    adv = torch.randn(n, ids.shape[1] - 1, generator=g)
    return ids.to(device), mask.to(device), adv.to(device)


NEW_TOKENS = 4


def _prompts(vocab: int) -> list[torch.Tensor]:
    """Each rank's two unpadded prompts of 7 tokens."""
    g = torch.Generator().manual_seed(13)
    return [torch.randint(3, vocab, (2, 7), generator=g) for _ in range(WORLD)]


def _model(device: torch.device):
    if device.type == "cuda":
        model = build_model(device, torch.bfloat16, config_overrides=GPU_WIDTH)
    else:
        model = build_model(device, torch.float32)
    return rlkernels.patch_model(model.train())


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _steps(model, ids, mask, adv) -> dict:
    """STEPS policy-gradient steps (AdamW); log-probs per step, grad and parameter digests."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict = {"logp": [], "loss": [], "grads": [], "params": None}
    for _ in range(STEPS):
        lp = rlkernels.token_logprobs(model, ids, mask)
        loss = -(lp * adv).sum()
        loss.backward()
        full = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                for n, p in model.named_parameters()}
        out["logp"].append(lp.detach().cpu())
        out["loss"].append(loss.detach().cpu())
        out["grads"].append(_digest(full))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = _digest({n: p.full_tensor() if hasattr(p, "full_tensor") else p
                             for n, p in model.named_parameters()})
    return out


def _fsdp_worker_cpu(rank: int, world: int, folder: str) -> None:
    _fsdp_worker(rank, world, folder, cuda=False)


def _fsdp_worker_cuda(rank: int, world: int, folder: str) -> None:
    _fsdp_worker(rank, world, folder, cuda=True)


def _fsdp_worker(rank: int, world: int, folder: str, cuda: bool) -> None:
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                            rank=rank, world_size=world)
    try:
        mesh = init_device_mesh(device.type, (world,))
        model = _model(device)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids, mask, adv = _batch(device, model.config.vocab_size)
        rows = slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
        # The sampler's side first: greedy generate from the rank's prompts (eager decode).
        prompts = _prompts(model.config.vocab_size)[rank]
        with torch.no_grad():
            sequences, sampled = rlkernels.generate(model, prompts.to(device), max_new_tokens=NEW_TOKENS)
        if rank == 0:
            try:
                rlkernels.generate(model, prompts.to(device), max_new_tokens=1, cuda_graph=True)
            except ValueError as exc:
                refusal = str(exc)
            else:
                refusal = None
        saved = _steps(model, ids[rows], mask[rows], adv[rows])
        saved.update(adv=adv[rows].cpu(), sequences=sequences.cpu(), sampled=sampled.cpu(),
                     refusal=refusal if rank == 0 else None)
        torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _one_process_logprobs(device: torch.device) -> torch.Tensor:
    """The first step's log-probs of every rank's sequences, scored together in one process."""
    model = _model(device)
    ids, mask, _ = _batch(device, model.config.vocab_size)
    with torch.no_grad():
        return rlkernels.token_logprobs(model, ids, mask).cpu()


def _check(runs: list[list[dict]], device: torch.device) -> None:
    first, second = runs
    for rank in range(WORLD):
        a, b = first[rank], second[rank]
        assert a["grads"] == b["grads"] and a["params"] == b["params"], rank  # run to run
        for step in range(STEPS):
            assert torch.equal(a["logp"][step], b["logp"][step]), (rank, step)
    one = _one_process_logprobs(device)
    for rank in range(WORLD):
        rows = slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
        got = first[rank]
        assert torch.equal(got["logp"][0], one[rows]), rank
        # the same reduction on the same device: the loss is the one-process loss of those sequences
        want = -(one[rows].to(device) * first[rank]["adv"].to(device)).sum()
        assert torch.equal(got["loss"][0], want.cpu()), rank
    # Generate on the sharded model: the one-process model's tokens and sampler log-probs.
    model = _model(device)
    for rank, prompts in enumerate(_prompts(model.config.vocab_size)):
        with torch.no_grad():
            sequences, sampled = rlkernels.generate(model, prompts.to(device), max_new_tokens=NEW_TOKENS)
        assert torch.equal(first[rank]["sequences"], sequences.cpu()), rank
        assert torch.equal(first[rank]["sampled"], sampled.cpu()), rank
    assert "cuda_graph=True is not supported on an FSDP2" in first[0]["refusal"]
    # The ranks share parameters: after the same reduce-scattered steps they agree.
    assert first[0]["params"] == first[1]["params"]


def test_fsdp2_training_steps_are_deterministic_and_score_like_one_process():
    runs = [run_world(WORLD, _fsdp_worker_cpu) for _ in range(2)]
    _check(runs, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA devices (NCCL)")
def test_fsdp2_nccl_training_steps_gpu():
    runs = [run_world(WORLD, _fsdp_worker_cuda, start_method="spawn") for _ in range(2)]
    _check(runs, torch.device("cuda"))
