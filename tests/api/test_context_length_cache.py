"""The api's context length from a GGUF: parsed once per file version, then read from the cache
(the header's parse takes seconds); an unreadable cache entry is parsed again."""

from __future__ import annotations

import gguf

from pagedserve.services.api.main import _context_length
from pagedserve.shared.model_source import resolve_model


def test_parsed_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    readers, parse = [], gguf.GGUFReader  # the file is parsed for real once; a later parse is counted, given that reader

    def reader(path):
        readers.append(readers[0] if readers else parse(path))
        return readers[-1]

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    path = resolve_model("smollm2")
    assert _context_length(path) == 8192 and len(readers) == 1
    [entry] = (tmp_path / "context_lengths").iterdir()
    assert entry.read_text() == "8192"
    entry.write_text("4096")  # what the next start reads, without parsing
    assert _context_length(path) == 4096 and len(readers) == 1
    entry.write_text("garbage")
    assert _context_length(path) == 8192 and entry.read_text() == "8192" and len(readers) == 2
