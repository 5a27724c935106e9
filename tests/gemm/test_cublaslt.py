"""The cuBLASLt-no-split backend's handling of process-global flags (CPU: fake accessors)."""
from __future__ import annotations

import pytest
import torch

from rlkernels.gemm import cublaslt


class _FakeTorchFlags:
    """Stands in for torch._C's flag accessors: one BLAS library, two flag pairs."""

    def __init__(self, library: str, pairs: dict) -> None:
        self.library, self.pairs = library, dict(pairs)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        flags = cublaslt.FLAGS
        monkeypatch.setattr(flags, "get_library", lambda: self.library)
        monkeypatch.setattr(flags, "set_library", lambda lib: setattr(self, "library", lib))
        monkeypatch.setattr(flags, "cublaslt", "cublaslt")
        monkeypatch.setattr(flags, "get_pair", {dt: (lambda dt=dt: self.pairs[dt]) for dt in self.pairs})
        monkeypatch.setattr(flags, "set_pair", {dt: (lambda r, s, dt=dt: self.pairs.__setitem__(dt, (r, s)))
                                                for dt in self.pairs})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# The states torch accepts ((True, False) is refused: split-K off needs reduced precision off).
@pytest.mark.parametrize("user_pair", [(True, True), (False, True), (False, False)])
def test_no_split_k_sets_and_restores_the_whole_state(monkeypatch, dtype, user_pair):
    # A caller who forbade split-K themselves must keep it forbidden after our call:
    # restoring through the public bool getter would have set allow_splitk to True.
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    fake = _FakeTorchFlags("cublas", {dtype: user_pair, other: (True, True)})
    fake.install(monkeypatch)
    with cublaslt.no_split_k(dtype):
        assert fake.library == "cublaslt"
        assert fake.pairs[dtype] == (False, False)
        assert fake.pairs[other] == (True, True)
    assert fake.library == "cublas"
    assert fake.pairs == {dtype: user_pair, other: (True, True)}


def test_no_split_k_restores_after_an_error(monkeypatch):
    fake = _FakeTorchFlags("default", {torch.bfloat16: (False, False), torch.float16: (True, True)})
    fake.install(monkeypatch)
    with pytest.raises(RuntimeError, match="inside"):
        with cublaslt.no_split_k(torch.bfloat16):
            raise RuntimeError("inside")
    assert fake.library == "default"
    assert fake.pairs[torch.bfloat16] == (False, False)


def test_this_torch_exposes_the_flag_pairs():
    # The direct accessors are what keeps allow_splitk intact; a torch without them
    # falls back to the public API (and this test says so).
    assert cublaslt.FLAGS.direct, "torch._C lacks the (allow_reduced_precision, allow_splitk) accessors"
    assert len(cublaslt.FLAGS.get_pair[torch.bfloat16]()) == 2


def test_public_api_fallback_keeps_the_pair():
    # The fallback for a torch without the torch._C accessors: the pair is read from
    # the public attribute and its _split_k twin, and written back as a tuple.
    name = cublaslt._reduction_flag(torch.bfloat16)
    saved = cublaslt._public_pair(name)
    try:
        for pair in [(False, False), (False, True), (True, True)]:
            cublaslt._set_public_pair(name, *pair)
            assert cublaslt._public_pair(name) == pair
    finally:
        cublaslt._set_public_pair(name, *saved)
    assert cublaslt._public_pair(name) == saved
