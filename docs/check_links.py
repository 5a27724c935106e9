"""Check that every relative link in README.md and docs/**/*.md points to a file that exists.

    python docs/check_links.py      # exit status 1 and one line per broken link

Anchors (``#...``) are checked against the target's headings (GitHub's slug rule).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", path.read_text(), re.M)}


def main() -> int:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = []
    for f in files:
        text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                bad.append(f"{f.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{f.relative_to(ROOT)}: {target} (no such heading)")
    print("\n".join(bad) or f"{len(files)} files, every link resolves")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
