"""The prepared-model cache: a second start reads what the first built and computes the same logits
bit for bit (prefill on packed weights, decode on the few-row kernels), in float32 and bfloat16;
the key follows the model file, dtype and knobs; a broken entry is rebuilt."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest
import torch

from pagedserve.services.gpu_worker import weight_cache
from pagedserve.services.gpu_worker.host_memory import HUGE_PAGE, huge_pages_zeros
from pagedserve.services.gpu_worker.kv_pool import KVPool
from pagedserve.services.gpu_worker.model.llama import build_model
from pagedserve.services.gpu_worker.startup import StartupPhases, last_phase
from tests.gpu_worker.family_checkpoints import VOCAB, save_checkpoint
from tests.gpu_worker.test_model import BLOCK_SIZE, BLOCK_TABLE, NUM_BLOCKS, run_step
from tests.waiting import wait_for

CPU = torch.device("cpu")


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    save_checkpoint("mistral", tmp_path / "model")
    return str(tmp_path / "model")


def _load(model: str, dtype: torch.dtype) -> tuple[torch.nn.Module, StartupPhases]:
    phases = StartupPhases()
    return weight_cache.load_model(model, dtype, CPU, build_model, phases), phases


def _logits(model) -> torch.Tensor:
    """A 30-token prefill then one decode token: [31, vocab]."""
    prompt = torch.randint(0, VOCAB, (31,), generator=torch.Generator().manual_seed(3)).tolist()
    kv_caches = KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches
    prefill = model.compute_logits(run_step(model, kv_caches, [(prompt[:30], 0, BLOCK_TABLE)]))
    decode = model.compute_logits(run_step(model, kv_caches, [(prompt[30:], 30, BLOCK_TABLE)]))
    return torch.cat([prefill, decode])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_second_start_reads_the_entry_and_computes_the_same_logits(checkpoint, dtype):
    built, phases = _load(checkpoint, dtype)
    path = weight_cache.entry_path(checkpoint, dtype)
    assert path.exists() and set(phases.seconds) == {"model", "cache"}
    loaded, phases = _load(checkpoint, dtype)
    assert set(phases.seconds) == {"model"}  # read, not built
    assert loaded is not built and loaded.dtype == dtype
    assert torch.equal(_logits(loaded), _logits(built))
    assert torch.equal(_logits(loaded), _logits(build_model(checkpoint, dtype, CPU)))


def test_key_follows_model_file_dtype_and_knobs(checkpoint, monkeypatch):
    key = weight_cache.cache_key(checkpoint, torch.float32)
    assert weight_cache.cache_key(checkpoint, torch.float32) == key
    assert weight_cache.cache_key(checkpoint, torch.bfloat16) != key
    monkeypatch.setenv("PAGEDSERVE_PACK_WEIGHTS", "0")
    assert weight_cache.cache_key(checkpoint, torch.float32) != key
    monkeypatch.delenv("PAGEDSERVE_PACK_WEIGHTS")
    monkeypatch.setenv("PAGEDSERVE_LOG_LEVEL", "debug")  # does not change what is prepared
    assert weight_cache.cache_key(checkpoint, torch.float32) == key
    weights = os.path.join(checkpoint, "model.safetensors")
    os.utime(weights, ns=(1, 1))
    assert weight_cache.cache_key(checkpoint, torch.float32) != key


def test_a_broken_entry_is_rebuilt_and_replaced(checkpoint):
    path = weight_cache.entry_path(checkpoint, torch.float32)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a model")
    model, phases = _load(checkpoint, torch.float32)
    assert set(phases.seconds) == {"model", "cache"}
    assert torch.equal(_logits(model), _logits(_load(checkpoint, torch.float32)[0]))


def test_off_builds_every_time(checkpoint, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_WEIGHT_CACHE", "0")
    _load(checkpoint, torch.float32)
    assert not weight_cache.cache_dir().exists()


def test_an_unusable_cache_directory_builds_and_serves(checkpoint, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "a-file"))  # models/ cannot be made in it
    model, phases = _load(checkpoint, torch.float32)
    assert set(phases.seconds) == {"model"}
    assert torch.equal(_logits(model), _logits(build_model(checkpoint, torch.float32, CPU)))


def test_only_the_newest_entries_that_fit_are_kept(checkpoint, monkeypatch):
    monkeypatch.setattr(weight_cache, "MAX_BYTES", 1)  # less than one entry: only the newest stays
    _load(checkpoint, torch.float32)
    _load(checkpoint, torch.bfloat16)
    assert [p.name for p in weight_cache.cache_dir().glob("*.pt")] == [
        weight_cache.entry_path(checkpoint, torch.bfloat16).name]


def test_phase_lines_name_what_the_worker_does(caplog):
    phases = StartupPhases()
    with caplog.at_level("INFO", logger="pagedserve.worker"):
        with phases.phase("model", "loading the model"):
            pass
        phases.begin("joining the stack")
    lines = [r.getMessage() for r in caplog.records]
    assert last_phase(lines) == "joining the stack"
    assert last_phase(lines[:2]) == "loading the model"
    assert last_phase(["[worker] 12:00 INFO x: other"]) is None
    assert list(phases.seconds) == ["model"] and phases.summary().startswith("start ")


def test_waiting_on_another_build_is_a_phase_up_shows(checkpoint, caplog):
    lock = weight_cache.cache_dir() / "build.lock"
    lock.parent.mkdir(parents=True)
    loaded = {}
    with caplog.at_level("INFO", logger="pagedserve.worker"), open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process building
        waiter = threading.Thread(target=lambda: loaded.update(result=_load(checkpoint, torch.float32)))
        waiter.start()
        wait_for(lambda: last_phase([r.getMessage() for r in caplog.records]), 60, "a phase line")
        assert last_phase([r.getMessage() for r in caplog.records]) == (
            f"waiting for another process preparing a model ({lock})")
        fcntl.flock(held, fcntl.LOCK_UN)
        waiter.join(60)
    assert list(loaded["result"][1].seconds) == ["model_wait", "model", "cache"]


def test_pool_memory_is_zero_aligned_and_untouched_until_written():
    pool = huge_pages_zeros((2, 64, 16, 2, 64), torch.bfloat16)
    assert pool.data_ptr() % HUGE_PAGE == 0 and pool.is_contiguous()
    assert not pool.any()
    pool[1, 3] = 1.5
    assert pool.sum().item() == 1.5 * 16 * 2 * 64


def test_waiting_on_another_kernel_build_is_a_phase_up_shows(tmp_path, monkeypatch, caplog):
    from pagedserve.services.gpu_worker import worker
    from pagedserve.services.gpu_worker.kernels import cpu_extensions

    loaded = []
    monkeypatch.setattr(cpu_extensions, "build_dir", lambda name: tmp_path / name)
    monkeypatch.setattr(cpu_extensions, "load", loaded.append)  # what it loads is not this test's
    lock = tmp_path / "gemv" / "pagedserve.flock"
    lock.parent.mkdir()
    phases = StartupPhases()
    with caplog.at_level("INFO", logger="pagedserve.worker"), open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process building gemv
        waiter = threading.Thread(target=worker._load_kernels, args=(phases,))
        waiter.start()
        wait_for(lambda: "gemv" in str(last_phase([r.getMessage() for r in caplog.records])), 60, "the wait")
        assert last_phase([r.getMessage() for r in caplog.records]) == (
            f"waiting for another process building the CPU kernel 'gemv' ({lock})")
        assert loaded == ["decode", "prefill", "fused"]
        fcntl.flock(held, fcntl.LOCK_UN)
        waiter.join(60)
    assert loaded == list(cpu_extensions.SOURCES)
    assert list(phases.seconds) == ["kernels_wait", "kernels"]
    assert last_phase([r.getMessage() for r in caplog.records]) == worker.KERNELS
