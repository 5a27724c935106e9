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
