"""Compile rankmeter's optional C modules in place, next to their sources:
service/rankmeter/_treader.c (`rankmeter eval`'s reader) and _events.c (the plain native
messages decoded and checked, events/decoder.py).

    python scripts/build_native.py [--check]

`make venv` runs it with the venv's python. Without a C compiler or Python's headers it
says so and exits 0: rankmeter then uses its pure-Python paths, the same results, slower
(docs/eval.md, docs/benchmarks.md). --check: exit 1 when a module cannot be built.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

PACKAGE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "service", "rankmeter"))
MODULES = {"_treader": "the pure-Python reader is used", "_events": "events are decoded in Python only"}


def main() -> int:
    failed = [name for name, fallback in MODULES.items() if not build(name, fallback)]
    return 1 if failed and "--check" in sys.argv else 0


def build(name: str, fallback: str) -> bool:
    source = os.path.join(PACKAGE, name + ".c")
    target = os.path.join(PACKAGE, name + sysconfig.get_config_var("EXT_SUFFIX"))
    # CC may be a command with arguments ("ccache gcc"), as make and setuptools allow.
    compiler = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("gcc") or shutil.which("cc"),) if c]
    include = sysconfig.get_paths()["include"]
    problem = None
    # A failed rebuild must not leave an old module behind while saying the Python reader is used.
    if os.path.exists(target):
        os.remove(target)
    if not compiler or shutil.which(compiler[0]) is None:
        problem = f"no C compiler ({' '.join(compiler) if compiler else 'gcc or cc'})"
    elif not os.path.exists(os.path.join(include, "Python.h")):
        problem = f"no Python.h in {include}"
    else:
        cmd = [*compiler, "-O2", "-shared", "-fPIC", "-Wall", "-I", include, source, "-o", target]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as error:
            problem = f"{' '.join(cmd)} failed: {error}"
        else:
            if done.returncode:
                problem = f"{' '.join(cmd)} failed: {done.stderr.strip()}"
    if problem:
        print(f"build_native: rankmeter.{name} not built ({problem}); {fallback}", file=sys.stderr)
        return False
    print(f"build_native: built {os.path.relpath(target)}", file=sys.stderr)
    return True


if __name__ == "__main__":
    sys.exit(main())
