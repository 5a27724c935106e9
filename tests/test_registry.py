"""The registry: one way to register an op, each op's tolerance class a row of the contract."""
from __future__ import annotations

import pytest
import torch

import rlkernels  # noqa: F401  (registers every op)
from rlkernels import contract
from rlkernels.registry import (BACKENDS, OpImpl, backend_object, implementation, register_backends,
                                registered_ops)


def test_every_registered_op_has_both_backends_and_a_contract_row():
    ops = registered_ops()
    assert {"matmul", "bmm", "linear_logprob", "linear_sample", "rms_norm", "softmax", "log_softmax",
            "flash_attn", "moe"} <= set(ops)
    for name, backends in ops.items():
        assert backends == tuple(sorted(BACKENDS)), (name, backends)
        for backend in backends:
            impl = implementation(name, backend)
            assert impl.op_name == name and impl.backend == backend
            # op_class names the tolerance its float64 comparison is held to.
            assert impl.op_class in contract.CONTRACT, (name, impl.op_class)


def test_backend_object_is_the_registered_implementations():
    cpu = torch.device("cpu")
    assert backend_object("matmul", cpu) is implementation("matmul", "torch").backend_impl
    assert backend_object("rms_norm", cpu, "torch") is implementation("rms_norm", "torch").backend_impl


def test_register_backends_makes_one_subclass_per_backend():
    class _Probe(OpImpl):
        op_class = "matmul"

        def forward(self, x):
            return x + self.backend_impl

    register_backends("_probe_op", _Probe, {"torch": 1, "triton": 2})
    try:
        torch_impl, triton_impl = implementation("_probe_op", "torch"), implementation("_probe_op", "triton")
        assert issubclass(torch_impl, _Probe) and torch_impl is not triton_impl
        assert torch_impl.__name__ == "ProbeTorch" and triton_impl.backend == "triton"
        assert int(torch_impl()(torch.tensor(1))) == 2 and int(triton_impl()(torch.tensor(1))) == 3
    finally:
        from rlkernels import registry
        registry._REGISTRY.pop("_probe_op")


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend"):
        register_backends("_bad_op", OpImpl, {"cuda": None})
