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


def test_the_readme_layout_names_the_package_as_it_is():
    # Every module or package the Layout lists under service/rankmeter/ exists, and every
    # top-level one that exists is listed: a moved module shows here.
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```")[1]
    package = block.split("service/rankmeter/", 1)[1].split("\ntests/", 1)[0]
    named = {n.strip() for line in package.splitlines() if line.startswith("  ") and not line.startswith("   ")
             for n in line.split("  ")[1].split(",")}
    assert "pipeline/" in named and "serve.py" in named  # the parsing finds the entries
    here = ROOT / "service" / "rankmeter"
    assert sorted(n for n in named if not (here / n).exists()) == []
    present = {f.name + ("/" if f.is_dir() else "") for f in here.iterdir()
               if (f.is_dir() and (f / "__init__.py").exists()) or (f.suffix == ".py" and not f.name.startswith("_"))}
    assert sorted(present - named) == []
