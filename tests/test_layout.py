"""The package's layers: imports go downward only, no import loop, no import-time side effects."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "rlkernels"

# Lower rank = lower layer. A module may import from its own rank or below.
RANKS = {
    "_env": 0, "_versions": 0, "kernels": 0,
    "runtime": 1,
    "gemm": 2,
    "registry": 3, "reference": 3, "testing": 3, "contract": 4,
    "ops": 5,
    "nn": 6,
    "integrations": 7, "parallel": 7,
    "check": 8,
    "__init__": 9,
    "bench": 10, "cli": 10,
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _rank(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return RANKS["__init__"]
    return RANKS[parts[1]]


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported rlkernels module, line) for every import in the file, wherever it stands."""
    tree = ast.parse(path.read_text())
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("rlkernels"):
                continue
            for alias in node.names:  # "from pkg import module" names a module
                sub = f"{mod}.{alias.name}"
                target = sub if (SRC.parent / (sub.replace(".", "/") + ".py")).exists() or \
                    (SRC.parent / sub.replace(".", "/")).is_dir() else mod
                found.append((target, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("rlkernels")]
    return found


FILES = sorted(p for p in SRC.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_go_downward(path):
    me = _module_name(path)
    bad = [(mod, line) for mod, line in _imports(path)
           if mod != "rlkernels" and _rank(mod) > _rank(me)]
    # The package __init__ is the public API: only bench/cli (above it) may import it by name.
    bad += [(mod, line) for mod, line in _imports(path) if mod == "rlkernels" and _rank(me) < RANKS["bench"]
            and me != "rlkernels"]
    assert not bad, f"{me} imports upward: {bad}"


def test_no_import_loop():
    graph = {_module_name(p): {m for m, _ in _imports(p) if m != "rlkernels"} for p in FILES}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError("import loop: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt in graph and not state.get(nxt):
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in graph:
        if not state.get(node):
            visit(node, [node])


def test_fresh_import_has_no_side_effects():
    # A fresh interpreter: importing the package or the CLI touches no GPU, installs no
    # override and registers every op.
    code = ("import torch, rlkernels, rlkernels.cli; "
            "assert not torch.cuda.is_initialized(); "
            "assert not rlkernels.is_batch_invariant_mode_enabled(); "
            "ops = rlkernels.registered_ops(); "
            "assert {'matmul', 'bmm', 'linear_logprob', 'rms_norm', 'softmax', 'log_softmax', 'flash_attn'} <= set(ops), ops")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_submodules_are_reachable_but_not_imported_with_the_package():
    # The README's API table names rlkernels.testing, .check, .parallel, .reference and .contract:
    # each is one attribute access away after `import rlkernels`, imported on that access.
    # rlkernels.check (the drift locator) loads without the model check's Hugging Face code.
    code = textwrap.dedent("""
        import sys
        import rlkernels
        lazy = ("testing", "check", "parallel", "reference", "contract")
        loaded = [m for m in lazy if "rlkernels." + m in sys.modules]
        assert not loaded, loaded
        assert set(lazy) <= set(dir(rlkernels))
        assert callable(rlkernels.testing.assert_batch_invariant)
        assert "rlkernels.testing" in sys.modules and "rlkernels.parallel" not in sys.modules
        had_transformers = "transformers" in sys.modules
        assert callable(rlkernels.check.locate_divergence)
        assert "rlkernels.check.model" not in sys.modules and "rlkernels.check.locate" not in sys.modules
        assert ("transformers" in sys.modules) == had_transformers
        assert callable(rlkernels.parallel.tree_linear)
        assert rlkernels.reference.__name__ == "rlkernels.reference"
        assert rlkernels.contract.__name__ == "rlkernels.contract"
        import rlkernels.testing as t
        assert t is rlkernels.testing
        try:
            rlkernels.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e), e
        else:
            raise AssertionError("rlkernels.no_such_name did not raise AttributeError")
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
