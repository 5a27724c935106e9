"""rlkernels.check.locate_divergence (check/drift.py) on tiny random-weight HF models and toy modules (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.check import DivergenceReport, Way, locate_divergence  # noqa: E402

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True)
LENGTHS = (5, 12, 9, 17)
PLANTED = "model.layers.1.mlp.down_proj"  # the middle layer of three


def _tiny(arch: str = "qwen3") -> nn.Module:
    torch.manual_seed(0)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **TINY))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    return model.eval()


def _seqs(lengths=LENGTHS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 300, (n,), generator=g) for n in lengths]


class _Planted(nn.Module):
    """Wraps a Linear; its output for a token depends on the rest of the batch (or on where padding goes)."""

    def __init__(self, inner: nn.Module, kind: str) -> None:
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.kind == "batch_size":
            return y + 1e-3 * x.shape[0]
        if self.kind == "row_sum":  # every row sees the sum over the batch
            return y + 1e-3 * y.sum(dim=0, keepdim=True)
        return y + 1e-3 * torch.arange(x.shape[1], dtype=y.dtype)[:, None]  # "position": the padded column index


def _plant(model: nn.Module, kind: str) -> nn.Module:
    mlp = model.model.layers[1].mlp
    mlp.down_proj = _Planted(mlp.down_proj, kind)
    return model


def _locate(model, *args, **kw) -> DivergenceReport:
    with rlkernels.set_batch_invariant_mode(True):
        return locate_divergence(model, *args, **kw)


# ---------------------------------------------------------------- (1) a planted non-invariant module


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["batch_size", "row_sum"])
def test_planted_module_is_named_first(arch, kind):
    model = _plant(rlkernels.patch_model(_tiny(arch)), kind)
    rep = _locate(model, _seqs(), "alone", "batch_right_padded")
    print(rep.table())
    assert rep.first is not None and rep.first.name == PLANTED and rep.first.type == "_Planted"
    assert rep.origin is rep.first and rep.first.input_differs is False
    assert rep.first.tokens == rep.tokens == sum(LENGTHS) and rep.first.differing == rep.tokens
    assert rep.first.fraction == 1.0 and 0 < rep.first.max_abs_diff < 1.0
    before = rep.modules[:rep.modules.index(rep.first)]
    assert len(before) > 10 and not any(m.differs for m in before)  # the inner Linear included
    assert f"{PLANTED}.inner" in [m.name for m in before]
    assert {PLANTED, "model.layers.1.mlp", "model.layers.1", "lm_head", "(model)"} <= {m.name for m in rep.divergent}
    assert "<- first" in rep.table() and PLANTED in str(rep)


def test_planted_padding_dependence_left_vs_right():
    # Only sequences shorter than the longest move when padding moves from right to left.
    model = _plant(rlkernels.patch_model(_tiny()), "position")
    rep = _locate(model, _seqs(), way_a="batch_left_padded", way_b="batch_right_padded")
    assert rep.first.name == PLANTED
    assert rep.first.differing == sum(LENGTHS) - max(LENGTHS)
    assert rep.first.fraction == pytest.approx(1 - max(LENGTHS) / sum(LENGTHS))


def test_planted_found_through_generic_ways():
    # Caller-built ways: every sequence alone vs a shuffled right-padded batch, scored by the decoder only.
    model = _plant(rlkernels.patch_model(_tiny()), "row_sum")
    seqs = _seqs()
    offsets = [sum(LENGTHS[:i]) for i in range(len(seqs))]
    order = [2, 0, 3, 1]
    L = max(LENGTHS)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    tmap = torch.full_like(ids, -1)
    for r, i in enumerate(order):
        n = len(seqs[i])
        ids[r, :n], mask[r, :n], tmap[r, :n] = seqs[i], 1, torch.arange(offsets[i], offsets[i] + n)
    alone = Way("rollout", [(lambda s=s: model.model(input_ids=s[None]), torch.arange(o, o + len(s))[None])
                            for s, o in zip(seqs, offsets)])
    batched = (lambda: model.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)),
               tmap)
    rep = _locate(model, way_a=alone, way_b=batched)
    assert (rep.way_a, rep.way_b) == ("rollout", "way_b")
    assert rep.first.name == PLANTED and rep.first.differing == rep.tokens == sum(LENGTHS)
    assert "lm_head" not in {m.name for m in rep.modules}  # the decoder alone ran


# ---------------------------------------------------------------- (2) stock, (3) patched


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_stock_names_a_non_invariant_module(arch):
    model = _tiny(arch)  # unpatched: SDPA attention, torch's CPU kernels
    seqs = _seqs()
    rep = locate_divergence(model, seqs, "alone", "batch_right_padded")
    print(f"\nstock {arch}:\n{rep}")
    assert rep.first is not None and rep.divergent[0] is rep.first
    # Independently: the named module's output for some token differs between the two ways,
    # and no module that returned earlier does.
    outs: dict[str, list[torch.Tensor]] = {}
    names = [m.name for m in rep.modules]
    mods = dict(model.named_modules())
    hooks = [mods[n].register_forward_hook(lambda m, a, o, n=n: outs.setdefault(n, []).append(
        (o[0] if isinstance(o, tuple) else o).detach())) for n in names[:names.index(rep.first.name) + 1]]
    try:
        with torch.no_grad():
            for s in seqs:
                model(input_ids=s[None])
            L = max(LENGTHS)
            ids = torch.zeros(len(seqs), L, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(seqs):
                ids[i, :len(s)], mask[i, :len(s)] = s, 1
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    finally:
        for h in hooks:
            h.remove()

    def same(name: str) -> bool:
        alone, batch = outs[name][:len(seqs)], outs[name][len(seqs)]
        return all(torch.equal(a[0], batch[i, :len(s)]) for i, (a, s) in enumerate(zip(alone, seqs)))

    assert not same(rep.first.name)
    assert all(same(n) for n in names[:names.index(rep.first.name)])


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("ways", [("alone", "batch_right_padded"), ("alone", "batch_left_padded"),
                                  ("batch_left_padded", "batch")])
def test_patched_model_reports_none(arch, ways):
    model = rlkernels.patch_model(_tiny(arch))
    rep = _locate(model, _seqs(), *ways)
    assert rep.first is None and rep.divergent == [] and rep.origin is None
    assert len(rep.modules) > 30 and rep.tokens == sum(LENGTHS)
    assert "first divergent module: none" in str(rep)


# ---------------------------------------------------------------- bits, skipped outputs


class _Toy(nn.Module):
    """Embedding, then: a NaN output (same bits both ways), a signed zero that flips with the batch size,
    and a pooled output that is not per-token."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.nan = _Const(float("nan"))
        self.zero = _SignedZero()
        self.pool = _Pool()

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        h = self.emb(input_ids)
        self.pool(h)
        return self.zero(self.nan(h))


class _Const(nn.Module):
    def __init__(self, v: float) -> None:
        super().__init__()
        self.v = v

    def forward(self, x):
        return torch.full_like(x, self.v)


class _SignedZero(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x) * (-1.0 if x.shape[0] > 1 else 1.0)


class _Pool(nn.Module):
    def forward(self, x):
        return x.sum(dim=1)


def test_bitwise_nan_safe_signed_zero_and_skipped():
    model = _Toy().eval()
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8])]
    rep = locate_divergence(model, seqs, "alone", "batch")
    by = {m.name: m for m in rep.modules}
    assert not by["emb"].differs and not by["nan"].differs  # NaN with the same bits is equal
    assert rep.first is by["zero"] and by["zero"].differing == 8 and by["zero"].max_abs_diff == 0.0
    assert rep.skipped == [("pool", "output shape (1, 6) is not per-token (does not start with the run's "
                                    "[B, L] = [1, 3])")]
    assert "skipped pool" in rep.table()


# ---------------------------------------------------------------- (4) bad arguments


def _ok_way():
    return (lambda: None, torch.tensor([[0, 1]]))


@pytest.mark.parametrize("call, exc, match", [
    (lambda m, s: locate_divergence("model", s), TypeError, "model must be a torch.nn.Module, got str"),
    (lambda m, s: locate_divergence(m, s, "alone", "padded"), ValueError,
     "unknown way_b 'padded'; expected one of alone, batch_right_padded, batch_left_padded, batch"),
    (lambda m, s: locate_divergence(m, None, "alone", "batch"), ValueError, "way_a='alone' needs input_ids"),
    (lambda m, s: locate_divergence(m, torch.ones(2, 4, dtype=torch.long)), TypeError,
     r"input_ids must be a list of 1-D token-id tensors .* shape \(2, 4\)"),
    (lambda m, s: locate_divergence(m, []), ValueError, "input_ids is empty"),
    (lambda m, s: locate_divergence(m, [s[0], s[1].float()]), TypeError,
     r"input_ids\[1\] must be a 1-D integer tensor, got torch.float32"),
    (lambda m, s: locate_divergence(m, [s[0], s[1][:0]]), ValueError, r"input_ids\[1\] is empty"),
    (lambda m, s: locate_divergence(m, s, pad_id=0.0), TypeError, "pad_id must be an integer token id, got 0.0"),
    (lambda m, s: locate_divergence(m, s, "alone", 3), TypeError, "way_b must be one of .* got int"),
    (lambda m, s: locate_divergence(m, None, _ok_way(), (lambda: None, torch.tensor([[0, 2]]))), ValueError,
     "the ways cover different tokens"),
    (lambda m, s: locate_divergence(m, None, _ok_way(), (lambda: None, torch.tensor([[0.0, 1.0]]))), TypeError,
     r"way_b run 0: token_map must be an integer \[B, L\] tensor, got torch.float32"),
    (lambda m, s: locate_divergence(m, None, _ok_way(), (lambda: None, torch.tensor([[0, 1, 1]]))), ValueError,
     r"way_b maps token 1 to more than one position \(run 0\)"),
    (lambda m, s: locate_divergence(m, None, _ok_way(), (lambda: None, torch.tensor([[0, 1, -2]]))), ValueError,
     "way_b run 0: token_map entries must be >= 0 .* or -1 .* got -2"),
    (lambda m, s: locate_divergence(m, None, (lambda: None, torch.tensor([[-1]])), (lambda: None, torch.tensor([[-1]]))),
     ValueError, "the token maps mark no token"),
    (lambda m, s: locate_divergence(m, None, Way("empty", []), _ok_way()), ValueError, "way_a 'empty' has no runs"),
    (lambda m, s: locate_divergence(m, s, include=lambda n, mod: False), ValueError, "include accepted no module"),
    (lambda m, s: locate_divergence(m, None, _ok_way(), _ok_way()), ValueError,
     "no hooked module returned a per-token"),
])
def test_bad_arguments(call, exc, match):
    model = _Toy().eval()
    with pytest.raises(exc, match="rlkernels.check.locate_divergence: " + match):
        call(model, [torch.tensor([1, 2]), torch.tensor([3, 4, 5])])


def test_training_mode_warns():
    with pytest.warns(UserWarning, match="training mode"):
        locate_divergence(_Toy().train(), [torch.tensor([1, 2])], "alone", "alone")

