"""Lines per module and per class over service/rankmeter, largest first (issue 18's limits:
no module above ~400 lines, no class above ~250).

    python scripts/code_size.py [--top 15] [root]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def sizes(root: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, module) and (lines, module:Class) for every .py file under `root`."""
    modules, classes = [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(root.parent))
        modules.append((len(text.splitlines()), name))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    return sorted(modules, reverse=True), sorted(classes, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(__file__).resolve().parent.parent / "service" / "rankmeter"
    parser.add_argument("root", nargs="?", default=str(default))
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    modules, classes = sizes(Path(args.root))
    print(f"modules ({len(modules)}, {sum(n for n, _ in modules)} lines):")
    for n, name in modules[:args.top]:
        print(f"  {n:5d}  {name}")
    print(f"classes ({len(classes)}):")
    for n, name in classes[:args.top]:
        print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main()
