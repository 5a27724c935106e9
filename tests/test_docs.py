"""The README and docs name only links and repository paths that exist (docs/check_links.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("check_links", ROOT / "docs" / "check_links.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_link_and_path_in_the_docs_resolves(capsys):
    assert _checker().main() == 0, capsys.readouterr().out


def test_the_checker_reports_broken_paths_and_links(tmp_path):
    checker = _checker()
    page = ROOT / "docs" / "x.md"
    text = "`src/rlkernels/no_such.py`, `gemm/table.py`, ``a `b` c``, `TB/s`, [x](no_such.md), [y](contract.md#nope)\n"
    bad = checker.check_text(page, text)
    assert any("no_such.py" in b for b in bad) and any("no_such.md" in b for b in bad)
    assert any("#nope" in b for b in bad)
    assert not any("table.py" in b or "TB/s" in b for b in bad)


def _layout_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def test_the_readme_layout_names_every_module_and_package():
    # The README's Layout block is the map a newcomer reads first: every package and every
    # module of src/rlkernels is named there (by its file or folder name, without .py).
    import re

    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", _layout_block()))
    src = ROOT / "src" / "rlkernels"
    names = {p.stem for p in src.rglob("*.py") if p.stem not in ("__init__", "__main__")}
    names |= {p.name for p in src.rglob("*") if p.is_dir() and (p / "__init__.py").exists()}
    missing = sorted(names - words)
    assert not missing, f"README.md's Layout block does not name: {missing}"
