"""The C++ decode kernel built for older CPUs than this one: -march=x86-64-v4 (AVX-512 without VNNI
or BF16), -march=haswell (AVX2 + FMA: the Vec8 walk, as on Zen 3) and -march=x86-64 (no vector walk:
the portable loop), each against the float32 reference for float32, bf16 and int8 pools.
-march=native builds only this CPU's path, so without these builds a change could break the others
unseen."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pagedserve.services.gpu_worker.attention.torch_paged import TorchPagedBackend
from pagedserve.services.gpu_worker.kernels import cpu_extensions
from tests.gpu_worker.test_attention import check_against_reference, make_step
from tests.gpu_worker.test_kv_quant import check_int8_against_reference, int8_step


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


# x86-64-v4: AVX-512 without VNNI or BF16 (Skylake-X): the Vec16 walk and the int8 one's vpmaddwd
ARCHES = {"x86-64-v4": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}, "haswell": {"avx2", "fma"},
          "x86-64": {"sse2"}}
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu_extensions.enabled() or not _cpu_flags(), reason="an x86 CPU and a compiler")]


def _isa_cache() -> Path:
    """Beside the kernels (TORCH_EXTENSIONS_DIR moves both): a clean clone finds the builds of an earlier run."""
    return cpu_extensions.build_dir("decode").parent / "isa_builds"


def _build(arch: str):
    """The -march=arch build, compiled once per (sources, headers, flags, torch) and loaded from then on."""
    from torch.utils import cpp_extension

    flags = ["-O3", f"-march={arch}", "-fopenmp", "-ffast-math", f"-DPAGEDSERVE_CPU={cpu_extensions.cpu_digest()}",
             *cpu_extensions.compile_flags("decode")[4:5]]  # the headers' hash: rebuilt when they change
    source = cpu_extensions.SOURCES["decode"]
    parts = [source.read_bytes(), *(h.read_bytes() for h in cpu_extensions.HEADERS["decode"]),
             " ".join(flags).encode(), torch.__version__.encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    name = f"pagedserve_cpu_decode_{arch.replace('-', '_')}_{digest}"
    directory = _isa_cache() / name
    with cpu_extensions._exclusive(directory / "pagedserve.flock"):
        if (directory / "pagedserve.stamp").exists():
            spec = importlib.util.spec_from_file_location(name, directory / f"{name}.so")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        module = cpp_extension.load(name=name, sources=[str(source)], build_directory=str(directory),
                                    extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
        (directory / "pagedserve.stamp").write_text(name)
        return module


@functools.cache
def _builds() -> dict[str, Future]:
    """Every build this CPU can run, compiled side by side (each is one single-threaded compiler:
    one after another they would leave the other cores idle); a failed build fails its own tests."""
    arches = [arch for arch, needs in ARCHES.items() if needs <= _cpu_flags()]
    with ThreadPoolExecutor(len(arches)) as pool:
        futures = {arch: pool.submit(_build, arch) for arch in arches}
    return futures


def _backend(arch: str) -> TorchPagedBackend:
    backend = TorchPagedBackend(use_kernel=True)
    backend._kernel, backend._prefill_kernel = _builds()[arch].result(), None  # decodes on the older build only
    return backend


REQUESTS = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 40), (1, 211)]


@pytest.mark.parametrize("arch", list(ARCHES))
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 3), (16, 128, 2), (24, 32, 1), (32, 64, 8)])
def test_older_cpu_builds_decode_every_pool_dtype_as_the_reference(arch, block_size, head_dim, group):
    if not ARCHES[arch] <= _cpu_flags():
        pytest.skip(f"this CPU cannot run a -march={arch} build")
    shape = dict(requests=REQUESTS, block_size=block_size, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                 seed=block_size + head_dim + group)
    for dtype in (torch.float32, torch.bfloat16):
        backend = _backend(arch)
        check_against_reference(backend, *make_step(dtype=dtype, **shape))
        assert backend._plan.kernel_decodes is not None and backend._plan.decodes == []
        check_int8_against_reference(_backend(arch), *int8_step(dtype=dtype, **shape))
