"""pagedserve's requirements for a machine without an NVIDIA GPU, for pip (install.sh, Dockerfile).

    python3 scripts/cpu_requirements.py [EXTRA,...]     # the dependencies and extras, less xgrammar and triton
    python3 scripts/cpu_requirements.py --no-deps       # what goes in without its dependencies

xgrammar (structured outputs) lists triton for every Linux x86-64 machine but imports it only for
its GPU kernel: on a CPU machine it goes in without its dependencies (its others are pagedserve's
own, and apache-tvm-ffi), so triton (about 1 GB) is never installed there.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
WITHOUT_DEPS = ("xgrammar",)
NEVER = ("triton",)


def main(argv: list[str]) -> int:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    if argv == ["--no-deps"]:
        print("\n".join([d for d in project["dependencies"] if d.startswith(WITHOUT_DEPS)] + ["apache-tvm-ffi"]))
        return 0
    extras = [d for name in (argv[0].split(",") if argv else []) for d in project["optional-dependencies"][name]]
    print("\n".join(d for d in project["dependencies"] + extras if not d.startswith(WITHOUT_DEPS + NEVER)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
