"""Compiled Triton reads only constexpr globals inside @jit functions; the interpreter reads any,
so CPU runs miss a plain float global. Checked statically here, in a child without the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = """
import types, triton, triton.language as tl
from pagedserve.services.gpu_worker.attention import triton_paged as m
bad = []
for name, fn in vars(m).items():
    if not isinstance(fn, triton.JITFunction):
        continue
    g = fn.fn.__globals__
    for used in fn.fn.__code__.co_names:
        if used not in g:
            continue
        v = g[used]
        if not isinstance(v, (types.ModuleType, triton.JITFunction, tl.constexpr)):
            bad.append(f"{name} reads {used} = {v!r}")
print("\\n".join(bad))
"""


def test_jit_functions_read_only_constexpr_globals():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.stdout.strip() == ""
