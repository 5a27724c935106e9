"""moe_topk / moe_experts: a token's bits do not depend on the other tokens, ties go to the
lowest expert id, the math is the stock blocks', the backward is deterministic."""
from __future__ import annotations

import pytest
import torch

from rlkernels import TOKEN_BLOCK, contract, reference
import rlkernels.ops.moe as moe_mod
from rlkernels.ops.moe import moe_experts, moe_topk, sum_ranks, top_k_lowest_id
from rlkernels.nn import MoeRouter
from rlkernels.registry import BackendUnavailableError, get_op, registered_ops

from ..conftest import HAS_CUDA, cpu_backend_cases, interpreter_only

H, INTER, E, K = 64, 32, 16, 4


def _weights(dtype, device="cpu", seed=0, experts=E, hidden=H, inter=INTER):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(device=device, dtype=dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(device=device, dtype=dtype)
    router = torch.randn(experts, hidden, generator=g).to(device=device, dtype=dtype)
    return router, gate_up, down


def _crowded_batch(target_ids: list[int], n: int, dtype, device="cpu", seed=1, experts=E):
    """Index/weights for ``n`` tokens: the first routed to ``target_ids``, the rest crowding
    two experts (one of them the target's first) and spread over half the others; the
    rest of the experts get no token."""
    g = torch.Generator().manual_seed(seed)
    k = len(target_ids)
    index = torch.empty(n, k, dtype=torch.long)
    index[0] = torch.tensor(target_ids)
    crowd = [target_ids[0], (target_ids[0] + 1) % experts]
    others = [e for e in range(experts // 2) if e not in crowd]
    for t in range(1, n):
        extra = torch.randperm(len(others), generator=g)[:k - 2].tolist()
        index[t] = torch.tensor(crowd + [others[i] for i in extra])
    weights = torch.softmax(torch.randn(n, k, generator=g), -1)
    x = torch.randn(n, H, generator=g).to(device=device, dtype=dtype)
    return x, index.to(device), weights.to(device)


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
def test_a_tokens_output_is_the_same_alone_and_in_a_crowded_batch(backend, dtype):
    _, gate_up, down = _weights(dtype)
    x, index, weights = _crowded_batch([3, 9, 12, 5], 97, dtype)
    counts = torch.bincount(index.reshape(-1), minlength=E)
    assert counts.max() >= 96 and (counts == 0).sum() >= 4  # some experts crowded, some empty
    batched = moe_experts(x, index, weights, gate_up, down, backend=backend)
    alone = moe_experts(x[:1], index[:1], weights[:1], gate_up, down, backend=backend)
    assert torch.equal(alone[0], batched[0])
    # Every other row too: alone, and in the batch reversed (other slots, other positions).
    flip = moe_experts(x.flip(0), index.flip(0), weights.flip(0), gate_up, down, backend=backend).flip(0)
    assert torch.equal(flip, batched)
    for t in (1, 50, 96):
        one = moe_experts(x[t:t + 1], index[t:t + 1], weights[t:t + 1], gate_up, down, backend=backend)
        assert torch.equal(one[0], batched[t]), t


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
def test_the_routed_layer_is_row_invariant_through_the_router(backend, dtype):
    op = get_op("moe", backend)
    router, gate_up, down = _weights(dtype)
    g = torch.Generator().manual_seed(5)
    v = torch.randn(H, generator=g)
    # 200 copies of one token crowd its 4 experts; the target sits in the middle.
    x = torch.cat([v.expand(100, H), torch.randn(1, H, generator=g), v.expand(100, H)]).to(dtype)
    batched = op(x, router, gate_up, down, K)
    alone = op(x[100:101], router, gate_up, down, K)
    assert torch.equal(alone[0], batched[100])
    assert torch.equal(op(x[:1], router, gate_up, down, K)[0], batched[0])


def test_the_op_is_registered_for_both_backends():
    assert registered_ops()["moe"] == ("torch", "triton")


def test_ties_go_to_the_lowest_expert_id():
    scores = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 1.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                           [0.1, 0.3, 0.3, 0.3, 0.2, 0.9]])
    assert top_k_lowest_id(scores, 3).tolist() == [[1, 2, 4], [0, 1, 2], [5, 1, 2]]
    # Through the softmax: equal logits give equal probabilities, so the same ids.
    logits = torch.zeros(4, E)
    logits[1, 7:] = 3.0
    logits[2, ::2] = -1.0
    logits[3, E - 1] = 5.0
    _, index = moe_topk(logits, K)
    assert index.tolist() == [[0, 1, 2, 3], [7, 8, 9, 10], [1, 3, 5, 7], [E - 1, 0, 1, 2]]
    # The same rows inside a larger batch of other rows get the same ids and weights.
    g = torch.Generator().manual_seed(0)
    big = torch.cat([torch.randn(50, E, generator=g), logits, torch.randn(50, E, generator=g)])
    w_big, i_big = moe_topk(big, K)
    w, i = moe_topk(logits, K)
    assert torch.equal(i_big[50:54], i) and torch.equal(w_big[50:54], w)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_is_the_stock_routers_math(normalize, dtype):
    g = torch.Generator().manual_seed(2)
    logits = (2 * torch.randn(300, E, generator=g)).to(dtype)
    weights, index = moe_topk(logits, K, normalize=normalize, round_weights_to=dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, K, dim=-1)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    # Rows whose k + 1 largest logits are distinct have one answer: the same experts, same order.
    # (bf16 logits collide: there stock's order among equal values is unspecified.)
    head = torch.sort(logits.float(), -1, descending=True).values[:, :K + 1]
    distinct = (head[:, 1:] != head[:, :-1]).all(-1)
    assert distinct.float().mean() > 0.8
    assert torch.equal(index[distinct], ids[distinct])
    assert weights.dtype == torch.float32
    assert (weights - top.to(dtype).float()).abs().max() <= (2e-7 if dtype == torch.float32 else 4e-3)


def _route_probs(rows: int, experts: int, seed: int, device="cpu") -> torch.Tensor:
    """Routing probabilities with ties (whole rows equal, runs of equal values) and NaN rows."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, experts, generator=g), -1)
    probs[1] = 1.0 / experts                                  # every expert ties
    probs[2, ::3] = probs[2].max()                            # a run of equal maxima
    probs[3, experts // 2:] = 0.0                             # equal zeros past the largest
    probs[4, 1] = float("nan")                                # torch.sort puts NaN first
    probs[5] = float("nan")
    return probs.to(device)


def _torch_route(probs, k, normalize):
    return moe_mod._TopKWeightsFunction.apply(probs, k, normalize, False)


def _fused_route(probs, k, normalize):
    return moe_mod._TopKWeightsFunction.apply(probs, k, normalize, True)


@interpreter_only
@pytest.mark.parametrize("experts, k", [(16, 4), (13, 1), (60, 4), (128, 8), (7, 7)])
@pytest.mark.parametrize("normalize", [True, False])
def test_fused_top_k_gives_the_sort_gather_and_sum_bits(experts, k, normalize):
    probs = _route_probs(37, experts, seed=experts + k)
    w_ref, i_ref = _torch_route(probs, k, normalize)
    w, i = _fused_route(probs, k, normalize)
    assert torch.equal(i, i_ref)
    assert torch.equal(w.view(torch.int32), w_ref.view(torch.int32))  # NaN rows too: bit patterns
    assert i[1].tolist() == list(range(k)) and i[4, 0] == 1


@interpreter_only
def test_fused_top_k_backward_is_the_torch_paths():
    probs = _route_probs(29, 16, seed=5)[6:].requires_grad_()
    grad = torch.randn(23, K, generator=torch.Generator().manual_seed(6))
    ref = torch.autograd.grad(_torch_route(probs, K, True)[0], probs, grad)[0]
    fused = torch.autograd.grad(_fused_route(probs, K, True)[0], probs, grad)[0]
    assert torch.equal(fused, ref)


@interpreter_only
@pytest.mark.parametrize("shape", [(1, 1, 1), (5, 3, 1031), (17, 8, 64), (2, 4, 2048)])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])  # bf16 stores: GPU test (interpreter limit)
def test_fused_rank_sum_gives_the_elementwise_ops_bits(shape, weighted, out_dtype):
    g = torch.Generator().manual_seed(sum(shape))
    T, k, H = shape
    slots = torch.randn(T, k, H, generator=g) * 30
    weights = torch.rand(T, k, generator=g).to(torch.bfloat16) if weighted else None
    ref = sum_ranks(slots, weights, out_dtype, fused=False)
    out = sum_ranks(slots, weights, out_dtype, fused=True)
    assert out.dtype == out_dtype and torch.equal(out, ref)
    # Strided slots (a [T, k, H] view of a wider buffer) read through their strides.
    wide = torch.randn(T, k, H + 3, generator=g)[:, :, :H]
    assert torch.equal(sum_ranks(wide, weights, out_dtype, fused=True), sum_ranks(wide, weights, out_dtype, fused=False))
    if weighted:  # weights whose ranks are not adjacent in memory
        cols = weights.t().contiguous().t()
        assert torch.equal(sum_ranks(slots, cols, out_dtype, fused=True), ref)


def test_routing_gradient_is_deterministic_and_correct():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, E, generator=g, dtype=torch.float64, requires_grad=True)
    fn = lambda lg: moe_topk(lg, K, normalize=True)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logits,))
    assert torch.autograd.gradcheck(lambda lg: moe_topk(lg, K, normalize=False)[0], (logits,))


def test_experts_gradcheck_float64():
    _, gate_up, down = _weights(torch.float64, experts=5, hidden=8, inter=4)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 8, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g, dtype=torch.float64)
    args = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
    assert torch.autograd.gradcheck(lambda a, w, gu, dn: moe_experts(a, index, w, gu, dn), args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accuracy_against_the_float64_reference(dtype):
    _, gate_up, down = _weights(dtype)
    x, index, weights = _crowded_batch([1, 2, 3, 4], 64, dtype)
    out = moe_experts(x, index, weights, gate_up, down)
    contract.check("moe", dtype, out, reference.moe_experts_ref(x, index, weights, gate_up, down))
    # The fp32 output is the combine before its one rounding.
    out32 = moe_experts(x, index, weights, gate_up, down, out_dtype=torch.float32)
    assert out32.dtype == torch.float32 and torch.equal(out32.to(dtype), out)


def _grads(x, index, weights, gate_up, down, grad, backend="torch"):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, gate_up, down)]
    out = moe_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], backend=backend)
    out.backward(grad)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
def test_backward_is_deterministic_and_a_tokens_dx_is_batch_invariant(backend, dtype):
    _, gate_up, down = _weights(dtype)
    x, index, weights = _crowded_batch([3, 9, 12, 5], 60, dtype)
    grad = torch.randn(60, H, generator=torch.Generator().manual_seed(9)).to(dtype)
    first = _grads(x, index, weights, gate_up, down, grad, backend)
    second = _grads(x, index, weights, gate_up, down, grad, backend)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    alone = _grads(x[:1], index[:1], weights[:1], gate_up, down, grad[:1], backend)
    assert torch.equal(alone[0][0], first[0][0]) and torch.equal(alone[1][0], first[1][0])
    # Experts nobody chose get a zero gradient.
    unused = sorted(set(range(E)) - set(index.reshape(-1).tolist()))
    assert unused and all(float(first[2][e].abs().max()) == 0 for e in unused)


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
def test_inference_and_training_forwards_give_the_same_bits(backend, dtype):
    _, gate_up, down = _weights(dtype)
    x, index, weights = _crowded_batch([3, 9, 12, 5], 30, dtype)
    with torch.no_grad():
        plain = moe_experts(x, index, weights, gate_up, down, backend=backend)
    graph = moe_experts(x.clone().requires_grad_(), index, weights, gate_up, down, backend=backend)
    assert graph.grad_fn is not None and torch.equal(graph.detach(), plain)


def test_backward_matches_autograd_of_the_plain_formula():
    _, gate_up, down = _weights(torch.float64)
    x, index, weights = _crowded_batch([3, 9, 12, 5], 30, torch.float64)
    weights = weights.double()
    grad = torch.randn(30, H, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    ours = _grads(x, index, weights, gate_up, down, grad)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, gate_up, down)]
    reference.moe_experts_ref(leaves[0], index, leaves[1], leaves[2], leaves[3]).backward(grad)
    for a, b in zip(ours, leaves):
        assert torch.allclose(a, b.grad, rtol=1e-10, atol=1e-12)


def test_weight_gradients_accumulate_into_main_grad_across_micro_batches():
    # The torch backend's chain is exact at any split: two micro-batches == one batch.
    _, gate_up, down = _weights(torch.float32)
    x, index, weights = _crowded_batch([3, 9, 12, 5], 40, torch.float32)
    grad = torch.randn(40, H, generator=torch.Generator().manual_seed(9))
    plain = _grads(x, index, weights, gate_up, down, grad)
    gu, dn = gate_up.clone().requires_grad_(), down.clone().requires_grad_()
    gu.main_grad = torch.zeros_like(gu)
    dn.main_grad = torch.zeros_like(dn)
    for part in (slice(0, 17), slice(17, 40)):
        moe_experts(x[part], index[part], weights[part], gu, dn).backward(grad[part])
    assert gu.grad is None and dn.grad is None
    assert torch.equal(gu.main_grad, plain[2]) and torch.equal(dn.main_grad, plain[3])


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
def test_main_grad_micro_batches_of_token_block_multiples_chain_like_one_batch(backend, dtype):
    # Each expert's dW continues its chain in main_grad, so micro-batches that route a
    # multiple of TOKEN_BLOCK tokens to every expert (all but the last micro-batch)
    # accumulate exactly like one batch: the promise rlkernels.linear makes for its token
    # counts, per expert (the torch backend's chain is exact at any split).
    tb, experts, hidden = TOKEN_BLOCK, 8, 16
    _, gate_up, down = _weights(dtype, experts=experts, hidden=hidden, inter=8)
    g = torch.Generator().manual_seed(6)
    # The first 2 * tb tokens: expert 0 gets 2 * tb of them, experts 1-3 and 5-7 tb each.
    first = torch.tensor([[0, 1, 2, 3]] * tb + [[0, 5, 6, 7]] * tb)
    rest = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(13)])
    index = torch.cat([first, rest])
    n = index.shape[0]
    x = torch.randn(n, hidden, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(n, K, generator=g), -1)
    grad = torch.randn(n, hidden, generator=g).to(dtype)
    starts = [torch.randn(w.shape, generator=g) for w in (gate_up, down)]

    def main_grads(parts):
        gu, dn = gate_up.clone().requires_grad_(), down.clone().requires_grad_()
        gu.main_grad, dn.main_grad = (s.clone() for s in starts)
        for part in parts:
            moe_experts(x[part], index[part], weights[part], gu, dn, backend=backend).backward(grad[part])
        assert gu.grad is None and dn.grad is None
        return gu.main_grad, dn.main_grad

    one = main_grads([slice(0, n)])
    split = main_grads([slice(0, 2 * tb), slice(2 * tb, n)])
    assert torch.equal(split[0], one[0]) and torch.equal(split[1], one[1])
    assert not torch.equal(one[0], starts[0]) and not torch.equal(one[1], starts[1])


def test_empty_batch():
    _, gate_up, down = _weights(torch.float32)
    out = moe_experts(torch.zeros(0, H), torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K), gate_up, down)
    assert out.shape == (0, H)


@pytest.mark.parametrize("change, match", [
    (dict(index=torch.tensor([[0, 16]])), r"top_k_index\[0, 1\] = 16 is not an expert id in \[0, 16\)"),
    (dict(index=torch.tensor([[-1, 2]])), r"top_k_index\[0, 0\] = -1"),
    (dict(index=torch.tensor([[0.0, 1.0]])), "must be int64 or int32"),
    (dict(weights=torch.ones(1, 3)), "must both be \\[T, k\\]"),
    (dict(down=torch.zeros(E, H, INTER + 1)), "down_proj must be \\[E, H, I\\]"),
    (dict(gate_up=torch.zeros(E, 2 * INTER, H + 1)), "gate_up_proj must be \\[E, 2 \\* I, H\\]"),
    (dict(x=torch.zeros(1, H, dtype=torch.float64)), "tensors must share one dtype"),
    (dict(x=torch.zeros(H)), "hidden_states must have 2 dims"),
])
def test_bad_input_is_refused(change, match):
    _, gate_up, down = _weights(torch.float32)
    args = dict(x=torch.randn(1, H), index=torch.tensor([[0, 1]]), weights=torch.ones(1, 2), gate_up=gate_up,
                down=down)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        moe_experts(args["x"], args["index"], args["weights"], args["gate_up"], args["down"])


def test_the_id_check_reads_back_only_where_asked(monkeypatch):
    """moe_experts range-checks the ids (one read back); check_ids=False, which the block
    passes for its router's ids, skips it: no sync per layer."""
    from rlkernels.ops import moe as moe_ops

    _, gate_up, down = _weights(torch.float32)
    x, index, weights = torch.randn(3, H), torch.tensor([[0, 1], [2, 3], [1, 5]]), torch.rand(3, 2)
    reads = []
    monkeypatch.setattr(moe_ops, "can_read_back", lambda t: reads.append(t) or False)
    checked = moe_experts(x, index, weights, gate_up, down)
    assert len(reads) == 1
    unchecked = moe_experts(x, index, weights, gate_up, down, check_ids=False)
    assert len(reads) == 1 and torch.equal(checked, unchecked)


@pytest.mark.parametrize("top_k", [0, E + 1, 2.0, True])
def test_bad_top_k_is_refused(top_k):
    with pytest.raises(ValueError, match="top_k must be an int"):
        moe_topk(torch.randn(3, E), top_k)


@pytest.mark.parametrize("round_to, err, match", [
    (torch.int32, ValueError, "round_weights_to must be a float dtype"),
    (torch.bool, ValueError, "round_weights_to must be a float dtype"),
    ("bf16", TypeError, r"round_weights_to must be None or a float torch.dtype \(torch.bfloat16"),
])
def test_round_weights_to_must_be_a_float_dtype(round_to, err, match):
    # An integer dtype once rounded every weight to 0, and a string failed inside torch.
    with pytest.raises(err, match=match):
        moe_topk(torch.randn(3, E), 2, round_weights_to=round_to)


def test_a_forced_backend_that_cannot_run_names_moe_topk(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match=r"rlkernels\.moe_topk: backend 'triton'"):
        moe_topk(torch.randn(3, E), 2, backend="triton")


@pytest.mark.parametrize("top_k", [2.7, 2.0, True])
def test_router_refuses_a_top_k_that_is_not_an_int(top_k):
    with pytest.raises(TypeError, match="MoeRouter: top_k must be an int"):
        MoeRouter(torch.nn.Parameter(torch.randn(E, 8)), top_k, normalize=True)


# ---------------------------------------------------------------- GPT-OSS's experts

GPT_OSS = moe_mod.GatedActivation(interleaved=True, limit=7.0, alpha=1.702)
GH, GI, GE = 24, 12, 10  # small enough for the interpreter's backward


def _gpt_oss_weights(dtype, device="cpu", seed=0, experts=GE, hidden=GH, inter=GI):
    """[E, H, 2I] and [E, I, H] weights with biases. The gate/up weights are scaled so
    that a few percent of the gate/up outputs pass the clamp at 7."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(experts, hidden, 2 * inter, generator=g) * 3.5 / hidden ** 0.5)
    down = torch.randn(experts, inter, hidden, generator=g) / inter ** 0.5
    gate_up_bias = torch.randn(experts, 2 * inter, generator=g)
    down_bias = torch.randn(experts, hidden, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (gate_up, down, gate_up_bias, down_bias)]


def _gpt_oss_batch(n, dtype):
    """_crowded_batch over GE experts, with GH features."""
    x, index, weights = _crowded_batch([3, 9, 2, 5], n, dtype, experts=GE)
    return x[:, :GH].contiguous(), index, weights


def _gpt_oss(x, index, weights, params, **kw):
    gate_up, down, gate_up_bias, down_bias = params
    return moe_experts(x, index, weights, gate_up, down, gate_up_bias=gate_up_bias, down_bias=down_bias,
                       activation=GPT_OSS, transposed=True, **kw)


def _gpt_oss_ref(x, index, weights, params):
    gate_up, down, gate_up_bias, down_bias = params
    return reference.moe_experts_ref(x, index, weights, gate_up, down, gate_up_bias=gate_up_bias,
                                     down_bias=down_bias, interleaved=True, limit=7.0, alpha=1.702, transposed=True)


def _gpt_oss_grads(x, index, weights, params, grad, backend="torch"):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, *params)]
    _gpt_oss(leaves[0], index, leaves[1], leaves[2:], backend=backend).backward(grad)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
def test_gpt_oss_experts_a_tokens_output_and_dx_are_the_same_alone_and_in_a_crowded_batch(backend, dtype):
    params = _gpt_oss_weights(dtype)
    x, index, weights = _gpt_oss_batch(31, dtype)
    with torch.no_grad():
        gu = torch.einsum("th,thi->ti", x[:8].double(), params[0].double()[index[:8, 0]])
    assert float(gu.abs().max()) > 7  # the clamp is reached
    batched = _gpt_oss(x, index, weights, params, backend=backend)
    for t in (0, 1, 17, 30):
        alone = _gpt_oss(x[t:t + 1], index[t:t + 1], weights[t:t + 1], params, backend=backend)
        assert torch.equal(alone[0], batched[t]), t
    grad = torch.randn(31, GH, generator=torch.Generator().manual_seed(9)).to(dtype)
    first = _gpt_oss_grads(x, index, weights, params, grad, backend)
    assert all(torch.equal(a, b) for a, b in zip(first, _gpt_oss_grads(x, index, weights, params, grad, backend)))
    alone = _gpt_oss_grads(x[:1], index[:1], weights[:1], params, grad[:1], backend)
    assert torch.equal(alone[0][0], first[0][0]) and torch.equal(alone[1][0], first[1][0])
    unused = sorted(set(range(GE)) - set(index.reshape(-1).tolist()))
    assert unused and all(float(g[e].abs().max()) == 0 for g in first[2:] for e in unused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_experts_against_the_float64_reference(dtype):
    params = _gpt_oss_weights(dtype)
    x, index, weights = _gpt_oss_batch(64, dtype)
    out = _gpt_oss(x, index, weights, params)
    contract.check("moe", dtype, out, _gpt_oss_ref(x, index, weights, params))
    # The stock SiLU formula on the same weights is another function: the test can fail.
    gate_up, down, *_ = params
    silu = moe_experts(x, index, weights, gate_up.mT.contiguous(), down.mT.contiguous())
    assert float((silu.double() - out.double()).abs().max()) > 0.1


def test_gpt_oss_experts_gradcheck_float64():
    params = _gpt_oss_weights(torch.float64, experts=5, hidden=8, inter=4)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 8, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g, dtype=torch.float64)
    args = [t.clone().requires_grad_() for t in (x, weights, *params)]
    assert torch.autograd.gradcheck(lambda a, w, *p: _gpt_oss(a, index, w, p), args)
    # And against autograd of the float64 formula, the clamp reached.
    grad = torch.randn(9, 8, generator=g, dtype=torch.float64)
    ours = _gpt_oss_grads(x, index, weights, params, grad)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, *params)]
    _gpt_oss_ref(leaves[0], index, leaves[1], leaves[2:]).backward(grad)
    for a, b in zip(ours, leaves):
        assert torch.allclose(a, b.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
def test_gpt_oss_gradients_chain_into_main_grad(backend, dtype):
    """main_grad on the transposed weights and the biases, in their own layout: the chains
    continued from zero are the returned gradients' chains before their one rounding."""
    params = _gpt_oss_weights(dtype)
    x, index, weights = _gpt_oss_batch(20, dtype)
    grad = torch.randn(20, GH, generator=torch.Generator().manual_seed(9)).to(dtype)
    plain = _gpt_oss_grads(x, index, weights, params, grad, backend)
    leaves = [t.clone().requires_grad_() for t in params]
    for t in leaves:
        t.main_grad = torch.zeros(t.shape)
    _gpt_oss(x, index, weights, leaves, backend=backend).backward(grad)
    for t, want in zip(leaves, plain[2:]):
        assert t.grad is None
        assert t.main_grad.dtype == torch.float32 and torch.equal(t.main_grad.to(dtype), want)


@pytest.mark.parametrize("change, err, match", [
    (dict(gate_up_bias=torch.zeros(GE, 2 * GI + 1)), ValueError, r"gate_up_bias must be \(10, 24\)"),
    (dict(down_bias=torch.zeros(GE - 1, GH)), ValueError, r"down_bias must be \(10, 24\)"),
    (dict(down_bias=torch.zeros(GE, GH, dtype=torch.float64)), ValueError, "tensors must share one dtype"),
    (dict(transposed=False), ValueError, r"down_proj must be \[E, H, I\]"),
    (dict(transposed=1), TypeError, "transposed must be a bool"),
    (dict(activation="swiglu"), TypeError, "activation must be a rlkernels.ops.moe.GatedActivation"),
    (dict(activation=moe_mod.GatedActivation(limit=-1.0)), ValueError, "limit must be > 0"),
    (dict(activation=moe_mod.GatedActivation(limit=7.0, alpha=float("nan"))), ValueError, "alpha must be a finite"),
])
def test_gpt_oss_bad_input_is_refused(change, err, match):
    gate_up, down, gate_up_bias, down_bias = _gpt_oss_weights(torch.float32)
    args = dict(gate_up_bias=gate_up_bias, down_bias=down_bias, activation=GPT_OSS, transposed=True)
    args.update(change)
    with pytest.raises(err, match=match):
        moe_experts(torch.randn(1, GH), torch.tensor([[0, 1]]), torch.ones(1, 2), gate_up, down, **args)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_crowded_batch_bitwise_and_deterministic_backward_gpu_bf16():
    dtype, dev = torch.bfloat16, "cuda"
    _, gate_up, down = (t.to(dev) for t in _weights(dtype, experts=64, hidden=512, inter=256))
    g = torch.Generator().manual_seed(1)
    n = 4096
    index = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(n)])  # 8 of 64 experts crowded
    index[0] = torch.tensor([3, 40, 41, 63])
    x = torch.randn(n, 512, generator=g).to(dev, dtype)
    weights = torch.softmax(torch.randn(n, 4, generator=g), -1).to(dev)
    index = index.to(dev)
    batched = moe_experts(x, index, weights, gate_up, down)
    for t in (0, 1, n - 1):
        assert torch.equal(moe_experts(x[t:t + 1], index[t:t + 1], weights[t:t + 1], gate_up, down)[0], batched[t])
    grad = torch.randn(n, 512, generator=g).to(dev, dtype)
    first = _grads(x, index, weights, gate_up, down, grad, backend=None)
    second = _grads(x, index, weights, gate_up, down, grad, backend=None)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    alone = _grads(x[:1], index[:1], weights[:1], gate_up, down, grad[:1], backend=None)
    assert torch.equal(alone[0][0], first[0][0]) and torch.equal(alone[1][0], first[1][0])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("experts, k", [(128, 8), (60, 4), (8, 2)])
def test_fused_top_k_gives_the_sort_gather_and_sum_bits_gpu(experts, k):
    """The one-launch top-k equals the torch ops on the GPU (IEEE division, no FMA)."""
    probs = _route_probs(4096, experts, seed=experts, device="cuda")
    for normalize in (True, False):
        w_ref, i_ref = _torch_route(probs, k, normalize)
        w, i = _fused_route(probs, k, normalize)
        bad = (i != i_ref).any(-1) | (w.view(torch.int32) != w_ref.view(torch.int32)).any(-1)
        assert not bad.any(), (normalize, bad.nonzero()[:4].flatten().tolist(), i[bad][:2], i_ref[bad][:2])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("experts, k", [(128, 8), (60, 4), (8, 2), (1024, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inference_routing_in_one_launch_gives_the_autograd_paths_bits_gpu(experts, k, dtype):
    """Without autograd the routing (softmax included) is one launch: the bits of the path
    autograd runs (rlkernels.softmax, then the top-k Function)."""
    g = torch.Generator().manual_seed(experts)
    logits = (torch.randn(3000, experts, generator=g) * 6).to(dtype)
    logits[1] = 0.5                      # ties everywhere
    logits[2, : experts // 2] = float("-inf")
    logits[3] = float("-inf")            # an all -inf row: NaN weights, as stock
    logits[4, 3] = float("nan")
    logits[5, 0] = float("inf")
    logits = logits.cuda()
    for normalize in (True, False):
        for rounding in (None, dtype):
            with torch.no_grad():
                w, i = moe_topk(logits, k, normalize=normalize, round_weights_to=rounding)
            w_ref, i_ref = moe_topk(logits.detach().requires_grad_(), k, normalize=normalize,
                                    round_weights_to=rounding)
            w_ref = w_ref.detach()
            bad = (i != i_ref).any(-1) | (w.view(torch.int32) != w_ref.view(torch.int32)).any(-1)
            assert not bad.any(), (normalize, rounding, bad.sum().item(), bad.nonzero()[:4].flatten().tolist(),
                                   (w - w_ref)[bad][:2].tolist())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_fused_rank_sum_gives_the_elementwise_ops_bits_gpu():
    """The one-launch combine equals k multiplies and k - 1 adds on the GPU: no FMA."""
    g = torch.Generator().manual_seed(7)
    for T, k, H in ((1, 8, 2048), (256, 8, 2048), (4099, 4, 1031)):
        slots = (torch.randn(T, k, H, generator=g) * 30).cuda()
        weights = torch.rand(T, k, generator=g).cuda()
        # None, rank-adjacent weights, and weights whose ranks are not adjacent in memory
        for w in (weights, None, weights.t().contiguous().t()):
            for dt in (torch.float32, torch.bfloat16):
                out, ref = sum_ranks(slots, w, dt, fused=True), sum_ranks(slots, w, dt, fused=False)
                assert torch.equal(out, ref), (T, k, H, w is None, dt, (out != ref).sum().item())
