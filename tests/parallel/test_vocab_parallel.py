"""TP-invariant vocab-parallel log-prob and entropy: the same bits at TP = 1, 2, 4, 8, forward and backward.

Each TP size runs as that many gloo processes on the CPU (``_workers.worker``); the
parent compares what the ranks saved against :func:`sharded_linear_logprob` in one process.
"""
from __future__ import annotations

import os

import pytest
import torch

from rlkernels import contract
from rlkernels._env import triton_interpret
from rlkernels.parallel import sharded_linear_logprob, vocab_parallel_linear_logprob
from rlkernels.reference import linear_logprob_ref

from . import _workers as W


def _one_process(dtype: torch.dtype, backend: str | None = None, truncated: bool = False, **transform):
    """logp, entropy and the grads (dh, dW, db) of the one-process op on the workers' inputs
    (``truncated``: with their thresholds, W.logprob_thresholds; ``transform``: the model's
    logit transform)."""
    h, w, b, t = W.logprob_inputs(dtype)
    tau = None
    if truncated:
        b, tau = W.logprob_thresholds(dtype)
    h, w, b = (x.clone().requires_grad_(True) for x in (h, w, b))
    lp, ent = sharded_linear_logprob(h, w, t, b, shards=W.SHARDS, temperature=W.TEMPERATURE, return_entropy=True,
                                     backend=backend, logit_threshold=tau, **transform)
    torch.autograd.backward((lp, ent), W.logprob_grads(t.numel()))
    return {"logp": lp.detach(), "ent": ent.detach(), "dh": h.grad, "dw": w.grad, "db": b.grad}


@pytest.mark.parametrize("dtype", W.dtypes(), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("truncated", [False, True], ids=["full", "truncated"])
def test_vocab_parallel_bitwise_across_tp(results, dtype, truncated):
    one = _one_process(dtype, truncated=truncated)
    vocab = one["dw"].shape[0]
    tag = W.names(dtype) + ("truncated/" if truncated else "")
    # Targets outside their kept set score -inf; nothing is NaN.
    assert all(torch.isfinite(one[name]).all() for name in ("ent", "dh", "dw", "db"))
    assert not torch.isnan(one["logp"]).any()
    for world in W.SIZES:
        for rank, out in enumerate(results[world]):
            rows = W.cols(vocab, world, rank)
            for name in ("logp", "ent", "dh", "db", "dw"):
                want = one[name][rows] if name in ("dw", "db") else one[name]
                assert torch.equal(out[tag + "vocab_" + name], want), (world, rank, name)


def test_a_transformed_head_is_the_one_process_bits_at_every_tp(results):
    # The model's logit scale and soft-cap, applied by each shard to its own logits.
    one = _one_process(torch.float32, **W.CAPPED)
    h, w, b, t = W.logprob_inputs(torch.float32)
    ref_lp, ref_ent = linear_logprob_ref(h, w, t, b, temperature=W.TEMPERATURE, **W.CAPPED)
    tol = contract.CONTRACT["linear_logprob"][torch.float32].tolerance
    assert float((one["logp"].double() - ref_lp).abs().max()) <= tol
    assert float((one["ent"].double() - ref_ent).abs().max()) <= tol
    for world in W.SIZES:
        for rank, out in enumerate(results[world]):
            rows = W.cols(w.shape[0], world, rank)
            for name in ("logp", "ent", "dh", "db", "dw"):
                want = one[name][rows] if name in ("dw", "db") else one[name]
                assert torch.equal(out["capped/vocab_" + name], want), (world, rank, name)


def test_empty_batch_at_every_tp(results):
    for world in W.SIZES:
        for out in results[world]:
            assert out["empty/logp"].shape == (0,) and out["empty/dh"].shape == (0, 45)
            assert torch.equal(out["empty/vocab_dw"], torch.zeros(384 // world, 45))


def test_planted_vocab_combines(results):
    """A wrong combine is caught: the shards' statistics in another order or by all_reduce
    (forward), the shards' dhidden partials folded or all-reduced (backward)."""
    ref = results[1][0]
    for world in (2, 4, 8):
        out = results[world][0]
        for plant in ("plant_reversed_ranks/", "plant_all_reduce_stats/"):
            assert not (torch.equal(out[plant + "vocab_logp"], ref["float32/vocab_logp"])
                        and torch.equal(out[plant + "vocab_ent"], ref["float32/vocab_ent"])), (world, plant)
    for plant in ("aten_sum", "sequential"):
        for world in (4, 8):
            out = results[world][0]
            assert not torch.equal(out[f"plant_{plant}/vocab_dh"], ref["float32/vocab_dh"]), (plant, world)
            # the forward does not use the rank combine: its bits stay
            assert torch.equal(out[f"plant_{plant}/vocab_logp"], ref["float32/vocab_logp"]), (plant, world)


def _logprob_f64(h, w, b, t, temperature):
    z = (h.double() @ w.double().t() + b.double()) / temperature
    ls = z.log_softmax(-1)
    valid = t >= 0
    lp = torch.where(valid, ls.gather(1, t.clamp(0)[:, None])[:, 0], torch.zeros(()).double())
    ent = torch.where(valid, -(ls.exp() * ls).sum(-1), torch.zeros(()).double())
    return lp, ent


def test_sharded_logprob_accuracy_vs_float64():
    for dtype in W.dtypes():
        h, w, b, t = W.logprob_inputs(dtype)
        got = _one_process(dtype)
        hd, wd, bd = (x.detach().double().requires_grad_(True) for x in (h, w, b))
        ref_lp, ref_ent = _logprob_f64(hd, wd, bd, t, W.TEMPERATURE)
        contract.check("linear_logprob", dtype, got["logp"], ref_lp.detach())
        contract.check("linear_logprob", dtype, got["ent"], ref_ent.detach())
        g_lp, g_ent = W.logprob_grads(t.numel())
        torch.autograd.backward((ref_lp, ref_ent), (g_lp.double(), g_ent.double()))
        for name, want in (("dh", hd.grad), ("dw", wd.grad), ("db", bd.grad)):
            contract.check("linear_logprob_grad", dtype, got[name], want)


def test_truncated_sharded_logprob_accuracy_vs_float64():
    """A kept set inside the first of eight shards: the other shards keep nothing and must
    merge as nothing, forward and backward."""
    for dtype in W.dtypes():
        h, w, _, _ = W.logprob_inputs(dtype)
        b, tau = W.logprob_thresholds(dtype)
        z = (h.double() @ w.double().T + b.double()) / W.TEMPERATURE
        t = z.argmax(dim=1)
        t[2] = -100
        hs, ws, bs = (x.clone().requires_grad_(True) for x in (h, w, b))
        lp, ent = sharded_linear_logprob(hs, ws, t, bs, shards=W.SHARDS, temperature=W.TEMPERATURE,
                                         return_entropy=True, logit_threshold=tau)
        g_lp, g_ent = W.logprob_grads(t.numel())
        torch.autograd.backward((lp, ent), (g_lp, g_ent))
        hd, wd, bd = (x.detach().double().requires_grad_(True) for x in (h, w, b))
        ref_lp, ref_ent = linear_logprob_ref(hd, wd, t, bd, temperature=W.TEMPERATURE, logit_threshold=tau)
        torch.autograd.backward((ref_lp, ref_ent), (g_lp.double(), g_ent.double()))
        contract.check("linear_logprob", dtype, lp.detach(), ref_lp.detach())
        contract.check("linear_logprob", dtype, ent.detach(), ref_ent.detach())
        for got, want in ((hs.grad, hd.grad), (ws.grad, wd.grad), (bs.grad, bd.grad)):
            contract.check("linear_logprob_grad", dtype, got, want)


def test_sharded_logprob_batch_invariance():
    h, w, b, t = W.logprob_inputs(torch.float32)
    full = sharded_linear_logprob(h, w, t, b, shards=4)
    for rows in (slice(0, 1), slice(3, 7), slice(0, 0)):
        assert torch.equal(sharded_linear_logprob(h[rows], w, t[rows], b, shards=4), full[rows])
    # the grad of a row's hidden is its own business too
    hs = h.clone().requires_grad_(True)
    sharded_linear_logprob(hs, w, t, b).sum().backward()
    one = h[5:6].clone().requires_grad_(True)
    sharded_linear_logprob(one, w, t[5:6], b).sum().backward()
    assert torch.equal(hs.grad[5:6], one.grad)


def test_sharded_logprob_accumulates_head_gradients_into_main_grad():
    """dW and dbias land in the parameters' fp32 main_grad (from zero: .grad's bits), dhidden
    unchanged; a main_grad of the wrong shape is refused naming the op."""
    h, w, b, t = W.logprob_inputs(torch.float32)
    g_lp, g_ent = W.logprob_grads(t.numel())
    grads = []
    for main in (False, True):
        hs, ws, bs = (x.clone().requires_grad_(True) for x in (h, w, b))
        if main:
            ws.main_grad, bs.main_grad = torch.zeros_like(w), torch.zeros_like(b)
        lp, ent = sharded_linear_logprob(hs, ws, t, bs, shards=W.SHARDS, return_entropy=True)
        torch.autograd.backward((lp, ent), (g_lp, g_ent))
        grads.append((hs.grad, ws.grad if not main else ws.main_grad, bs.grad if not main else bs.main_grad))
        if main:
            assert ws.grad is None and bs.grad is None
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    ws = w.clone().requires_grad_(True)
    ws.main_grad = torch.zeros(w.shape[0], 3)
    with pytest.raises(ValueError, match=r"rlkernels.sharded_linear_logprob: weight.main_grad must be"):
        sharded_linear_logprob(h, ws, t, b, shards=W.SHARDS).sum().backward()


def test_ignored_rows_get_zero_gradient():
    h, w, b, t = W.logprob_inputs(torch.float32)
    hs = h.clone().requires_grad_(True)
    lp, ent = sharded_linear_logprob(hs, w, t, b, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert lp[3] == 0 and ent[3] == 0 and torch.equal(hs.grad[3], torch.zeros_like(hs.grad[3]))


def test_sharded_logprob_refusals():
    h, w, b, t = W.logprob_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"rlkernels.sharded_linear_logprob: V=384 is not divisible by shards=256"):
        sharded_linear_logprob(h, w, t, b, shards=256)
    with pytest.raises(ValueError, match=r"rlkernels.sharded_linear_logprob: shards must be a power of two.*3"):
        sharded_linear_logprob(h, w, t, b, shards=3)
    with pytest.raises(ValueError, match=r"rlkernels.sharded_linear_logprob: target id 384"):
        sharded_linear_logprob(h, w, torch.full_like(t, 384), b)
    with pytest.raises(RuntimeError, match=r"rlkernels.vocab_parallel_linear_logprob: torch.distributed"):
        vocab_parallel_linear_logprob(h, w, t, b)
    with pytest.raises(TypeError, match=r"temperature must be a Python number \(float or int\), got Tensor "):
        sharded_linear_logprob(h, w, t, b, temperature=torch.tensor(0.7))


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
def test_triton_backend_equals_across_tp_in_one_process():
    """The fused Triton backend per shard (interpreter, fp32): the one-process op is accurate
    and its shards run on head slices give the bits of separate shard tensors."""
    got = _one_process(torch.float32, backend="triton")
    h, w, b, t = W.logprob_inputs(torch.float32)
    hd, wd, bd = (x.double() for x in (h, w, b))
    ref_lp, ref_ent = _logprob_f64(hd, wd, bd, t, W.TEMPERATURE)
    contract.check("linear_logprob", torch.float32, got["logp"], ref_lp)
    contract.check("linear_logprob", torch.float32, got["ent"], ref_ent)

# ---------------------------------------------------------------- several GPUs (NCCL)
# TP = 2, 4 and 8, each where that many devices are visible, on a 151936-row head, forward
# and backward, against the sharded one-process op on one GPU.

TOKENS, DIM, VOCAB = 1024, 4096, 151936


def _head_inputs():
    g = torch.Generator().manual_seed(7)
    h = torch.randn(TOKENS, DIM, generator=g).bfloat16()
    w = (torch.randn(VOCAB, DIM, generator=g) * 2 / DIM ** 0.5).bfloat16()
    t = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    t[5] = -100
    g_lp, g_ent = torch.randn(TOKENS, generator=g), torch.randn(TOKENS, generator=g)
    return h, w, t, g_lp, g_ent


def _run_head(h, w, t, g_lp, g_ent, fn, **kw):
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fn(h, w, t, return_entropy=True, **kw)
    torch.autograd.backward((lp, ent), (g_lp, g_ent))
    return {"logp": lp.detach().cpu(), "ent": ent.detach().cpu(), "dh": h.grad.cpu(), "dw": w.grad.cpu()}


def _nccl_head_worker(rank: int, world: int, folder: str) -> None:
    with W.nccl_group(rank, world, folder) as dev:
        h, w, t, g_lp, g_ent = (a.to(dev) for a in _head_inputs())
        out = _run_head(h, w[W.cols(VOCAB, world, rank)], t, g_lp, g_ent, vocab_parallel_linear_logprob)
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


@pytest.mark.gpu
@pytest.mark.parametrize("world", W.NCCL_SIZES)
def test_nccl_vocab_parallel_head_equals_one_gpu(world):
    ranks = W.run_nccl_world(world, _nccl_head_worker)
    h, w, t, g_lp, g_ent = (a.cuda() for a in _head_inputs())
    one = _run_head(h, w, t, g_lp, g_ent, sharded_linear_logprob)
    for rank, out in enumerate(ranks):
        for key in ("logp", "ent", "dh"):
            assert torch.equal(out[key], one[key]), (key, rank)
        assert torch.equal(out["dw"], one["dw"][W.cols(VOCAB, world, rank)]), rank
