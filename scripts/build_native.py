"""Compile rankmeter's optional C reader (service/rankmeter/_treader.c) in place, next to it.

    python scripts/build_native.py [--check]

`make venv` runs it with the venv's python. Without a C compiler or Python's headers it
says so and exits 0: `rankmeter eval` then reads with its pure-Python reader, the same
results, slower (docs/eval.md). --check: exit 1 when the module cannot be built.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

SOURCE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "service", "rankmeter", "_treader.c"))


def main() -> int:
    target = os.path.join(os.path.dirname(SOURCE), "_treader" + sysconfig.get_config_var("EXT_SUFFIX"))
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
        cmd = [*compiler, "-O2", "-shared", "-fPIC", "-Wall", "-I", include, SOURCE, "-o", target]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as error:
            problem = f"{' '.join(cmd)} failed: {error}"
        else:
            if done.returncode:
                problem = f"{' '.join(cmd)} failed: {done.stderr.strip()}"
    if problem:
        print(f"build_native: rankmeter._treader not built ({problem}); the pure-Python reader is used",
              file=sys.stderr)
        return 1 if "--check" in sys.argv else 0
    print(f"build_native: built {os.path.relpath(target)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
