"""The README's relative links resolve. docs/ is checked by `make docs` (MkDocs, strict);
the README is outside its site, so its links into docs/ are checked here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_relative_link_of_the_readme_names_a_file_of_the_repository():
    text = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    assert "docs/events.md" in targets  # the pattern finds the links it should
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert missing == []
