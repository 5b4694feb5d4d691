"""Prepared CPU models cached across starts: the model as build_model leaves it (dequantized,
concatenated, packed for this CPU's kernels) saved once with torch.save and memory-mapped back.

Keyed by the model files (path, size, mtime), dtype, this CPU's flags, torch's version, the
source of the model and kernel code and the PAGEDSERVE_* knobs that change preparation, so a
stale entry is never read: it is simply not found. oneDNN's packed weights are opaque (no
storage): they are saved as their plain weight and packed again on load (a fraction of a second).
Any failure to read or write an entry falls back to building the model; PAGEDSERVE_WEIGHT_CACHE=0
turns the cache off. Entries live in $PAGEDSERVE_CACHE_DIR/models, the most recently used kept
while they fit MAX_BYTES.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import types
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model.linear import PACK_BATCH_HINT
from pagedserve.services.gpu_worker.startup import StartupPhases, held_lock
from pagedserve.shared.model_source import resolve_model
from pagedserve.shared.tokenizer import _cache_root as cache_root

log = logging.getLogger("pagedserve.worker")

MAX_BYTES = 4 << 30  # SmolLM2's entry: 562 MiB in bfloat16
FORMAT = 1  # bump when what an entry holds changes
GPU_WORKER = Path(__file__).parent
# code whose change can change a prepared model: every source file under these folders
CODE_DIRS = (GPU_WORKER / "model", GPU_WORKER / "kernels")
# knobs that do not change preparation (everything else named PAGEDSERVE_* goes into the key)
NEUTRAL_ENV = {"PAGEDSERVE_PREFIX", "PAGEDSERVE_LOG_LEVEL", "PAGEDSERVE_API_KEY", "PAGEDSERVE_CACHE_DIR",
               "PAGEDSERVE_WEIGHT_CACHE"}


def enabled(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get("PAGEDSERVE_WEIGHT_CACHE", "1") not in ("0", "false", "no")


def cache_dir() -> Path:
    return Path(cache_root()) / "models"


def _model_files(path: str) -> list[Path]:
    root = Path(path)
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]


def cache_key(model: str, dtype: torch.dtype) -> str:
    """Hex digest of everything a prepared model depends on."""
    h = hashlib.sha256(f"{FORMAT}\0{dtype}\0{cpu_extensions.cpu_digest()}\0{torch.__version__}\0".encode())
    for f in _model_files(resolve_model(model)):
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for directory in CODE_DIRS:
        for f in sorted(directory.glob("*")):
            if f.suffix in (".py", ".cpp", ".h"):
                h.update(f.name.encode() + b"\0" + f.read_bytes())
    for name in sorted(os.environ):
        if name.startswith("PAGEDSERVE_") and name not in NEUTRAL_ENV:
            h.update(f"{name}={os.environ[name]}\0".encode())
    return h.hexdigest()


def entry_path(model: str, dtype: torch.dtype) -> Path:
    stem = Path(resolve_model(model).rstrip("/")).stem
    return cache_dir() / f"{stem}-{str(dtype).removeprefix('torch.')}-{cache_key(model, dtype)[:20]}.pt"


def _kernel(name: str):
    return cpu_extensions.load(name)


def _pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def _packed_sources(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """id(oneDNN packed weight) -> the plain tensor it packs, where an object holds both (`packed`
    beside `weight`) and they are equal; saving that reference avoids a second copy in the file."""
    sources: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for obj in vars(module).values():
            packed, weight = getattr(obj, "packed", None), getattr(obj, "weight", None)
            if (isinstance(packed, torch.Tensor) and packed.is_mkldnn and isinstance(weight, torch.Tensor)
                    and weight.dtype == packed.dtype and torch.equal(packed.to_dense(), weight.detach())):
                sources[id(packed)] = weight
    return sources


def _pickle_module(model: torch.nn.Module):
    kernels = {id(m): name for name in cpu_extensions.SOURCES if (m := cpu_extensions.load(name)) is not None}
    sources = _packed_sources(model)

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, types.ModuleType):  # a compiled kernel: loaded again by name
                if id(obj) not in kernels:
                    raise pickle.PicklingError(f"module {obj.__name__} is not a CPU kernel")
                return _kernel, (kernels[id(obj)],)
            if isinstance(obj, torch.Tensor) and obj.is_mkldnn:
                source = sources.get(id(obj))
                return _pack, (source.detach() if source is not None else obj.to_dense(), PACK_BATCH_HINT)
            return NotImplemented

    return types.SimpleNamespace(Pickler=Pickler, Unpickler=pickle.Unpickler, __name__="weight_cache_pickle")


def save(model: torch.nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        torch.save(model, tmp, pickle_module=_pickle_module(model))
        os.replace(tmp, path)  # readers see a whole entry or none
    finally:
        tmp.unlink(missing_ok=True)
    prune()


def prune() -> None:
    """Keeps the most recently used entries while they fit MAX_BYTES together (the newest always)."""
    entries = sorted(cache_dir().glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    total = 0
    for i, entry in enumerate(entries):
        total += entry.stat().st_size
        if i and total > MAX_BYTES:
            entry.unlink(missing_ok=True)


def load(path: Path) -> torch.nn.Module:
    """The saved model; its tensors map the file (pages shared by every worker reading it)."""
    model = torch.load(path, weights_only=False, mmap=True)
    os.utime(path)  # most recently used: pruned last
    return model


def load_model(model: str, dtype: torch.dtype, device: torch.device,
               build: Callable[[str, torch.dtype, torch.device], torch.nn.Module],
               phases: StartupPhases) -> torch.nn.Module:
    """The prepared model: from the cache, else build(model, dtype, device), saved for the next
    start. One builder at a time: a second worker starting beside the first waits, then reads."""
    if not enabled(device):
        return _build(model, dtype, device, build, phases, "")
    path = entry_path(model, dtype)
    with contextlib.ExitStack() as held:
        try:
            lock = cache_dir() / "build.lock"
            held.enter_context(held_lock(lock, phases, "model_wait", f"waiting for another process preparing a model ({lock})"))
        except OSError as e:  # an unwritable cache directory: serve as with the cache off
            log.warning("weight cache: %s unusable (%s: %s); preparing the model at every start", cache_dir(),
                        type(e).__name__, e)
            return _build(model, dtype, device, build, phases, "")
        if path.exists():
            try:
                with phases.phase("model", f"loading {model} prepared for this CPU from {path}"):
                    return load(path)
            except Exception as e:  # a truncated or unreadable entry: rebuild it
                log.warning("weight cache: cannot read %s (%s: %s); rebuilding", path, type(e).__name__, e)
        prepared = _build(model, dtype, device, build, phases, " (once: cached for later starts)")
        try:
            with phases.phase("cache", f"saving the prepared model to {path}"):
                save(prepared, path)
            log.info("weight cache: saved %s (%.0f MiB)", path, path.stat().st_size / 2**20)
        except Exception as e:  # unwritable or unpicklable: serve anyway, build again next start
            log.warning("weight cache: cannot save %s (%s: %s)", path, type(e).__name__, e)
        return prepared


def _build(model: str, dtype: torch.dtype, device: torch.device, build, phases: StartupPhases, note: str):
    with phases.phase("model", f"loading {model}: reading, dequantizing and packing the weights{note}"):
        return build(model, dtype, device)
