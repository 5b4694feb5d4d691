"""Paged attention backends (`AttentionBackend`): torch for the CPU, Triton for GPUs, a test reference."""

from pagedserve.services.gpu_worker.attention.metadata import AttentionBackend, AttentionMetadata

BACKENDS = ("torch", "triton", "reference")


def get_backend(name: str) -> AttentionBackend:
    """A fresh backend by name. Imports lazily: only "triton" needs the triton package."""
    if name == "torch":
        from pagedserve.services.gpu_worker.attention.torch_paged import TorchPagedBackend

        return TorchPagedBackend()
    if name == "triton":
        from pagedserve.services.gpu_worker.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend()
    if name == "reference":
        from pagedserve.services.gpu_worker.attention.reference import ReferenceBackend

        return ReferenceBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "get_backend"]
