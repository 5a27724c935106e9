"""Check that every relative link, and every repository path named in backticks, in
README.md, CONTRIBUTING.md, docs/**/*.md and benchmarks/**/*.md points to something that exists.

    python docs/check_links.py      # exit status 1 and one line per broken reference

Links: anchors (``#...``) are checked against the target's headings (GitHub's slug rule).
Backticked paths: a span with no spaces that contains ``/`` and ends in a file suffix
(``.py``, ``.md``, ``.json``, ...) or in ``/`` counts as a path; it may be written from the
repository root, from ``src/`` or ``src/rlkernels/``, or relative to the page. A trailing
``::test`` or ``:line`` is ignored; spans with ``<``, ``*``, ``{`` or ``$`` are patterns,
not paths. Standard library only (it runs in CI before the package is installed).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A code span: a run of backticks, then text, closed by a run of the same length (CommonMark).
CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
SUFFIXES = (".py", ".md", ".json", ".log", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml", ".ipynb")
BASES = (ROOT, ROOT / "src", ROOT / "src" / "rlkernels")


def slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def repo_path(span: str) -> str | None:
    """The path a backticked span names, or None when it is not a path."""
    span = span.strip()
    if " " in span or "/" not in span or "://" in span or any(c in span for c in "<*{$"):
        return None
    span = re.sub(r"(::\w.*|:\d+(-\d+)?)$", "", span)
    if span.startswith(("./", "../")) and not span.endswith(SUFFIXES + ("/",)):
        return None
    return span if span.endswith(SUFFIXES + ("/",)) else None


def path_exists(path: str, page: Path) -> bool:
    bases = (page.parent, *BASES)
    return any((base / path).exists() for base in bases)


def check(page: Path) -> list[str]:
    return check_text(page, page.read_text())


def check_text(page: Path, text: str) -> list[str]:
    """The broken references in ``text``, read as the page at ``page``."""
    bad = []
    rel = page.relative_to(ROOT)
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for _, span in CODE.findall(text):
        path = repo_path(span)
        if path is not None and not path_exists(path, page):
            bad.append(f"{rel}: `{span}` (no such path)")
    for target in LINK.findall(CODE.sub("", text)):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{rel}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{rel}: {target} (no such heading)")
    return bad


def main() -> int:
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    bad = [line for page in pages for line in check(page)]
    print("\n".join(bad) or f"{len(pages)} files: every link and path resolves")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
