"""opaque_to_compile: eager calls run the function itself, dynamo runs it eagerly (a graph
break), and importing rlkernels imports neither dynamo nor FSDP."""
from __future__ import annotations

import subprocess
import sys

import torch

from rlkernels.runtime.opaque import opaque_to_compile


def test_importing_rlkernels_imports_neither_dynamo_nor_fsdp():
    # Each is most of a second; before, every `import rlkernels` and CLI call paid both.
    code = ("import sys, rlkernels; print(sorted(m for m in ('torch._dynamo', 'torch.distributed.fsdp') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_compiled_callers_run_the_function_eagerly_and_eager_callers_run_it_directly():
    traced: list[bool] = []

    @opaque_to_compile
    def inner(x: torch.Tensor) -> torch.Tensor:
        traced.append(torch.compiler.is_compiling())  # True only where dynamo traces this frame
        return x.sin() * 2

    x = torch.randn(7)
    assert torch.equal(inner(x), x.sin() * 2) and traced == [False]
    assert inner.__name__ == "inner"
    compiled = torch.compile(lambda t: inner(t + 1) - 1, backend="eager")
    traced.clear()
    assert torch.equal(compiled(x), (x + 1).sin() * 2 - 1)
    assert traced == [False]  # run once, eagerly, not traced
    traced.clear()
    compiled(x)  # the cached graph calls it again, still eagerly
    assert traced == [False]
