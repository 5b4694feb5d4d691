"""The model's tokenizer: text <-> token ids and the chat template, for api and tests.

Served by the `tokenizers` library and jinja2 (shared/chat_template.py) without importing
transformers or torch: transformers runs once per model version to build the tokenizer, and its
backend (tokenizer.json) and what the api needs of the rest (tokenizer_meta.py) are cached under
$PAGEDSERVE_CACHE_DIR/tokenizers; later loads read that. `.hf` gives transformers' tokenizer
on demand (the worker's grammar compiler and tests use it). Unwritable cache: transformers each time.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

from pagedserve.shared.chat_template import pick_template, render_chat
from pagedserve.shared.model_source import find_gguf_in_dir, resolve_model
from pagedserve.shared.tokenizer_meta import (
    TokenizerMeta,
    cache_key,
    clean_up_tokenization,
    generation_eos_ids,
    meta_of,
    read_meta,
    write_meta,
)


class Tokenizer:
    def __init__(self, hf_tokenizer, extra_eos_token_ids: list[int] | tuple[int, ...] = ()):
        """From transformers' tokenizer (a first load, tests); `from_backend` is the cached path."""
        from tokenizers import Tokenizer as Backend

        fast = getattr(hf_tokenizer, "backend_tokenizer", None) if getattr(hf_tokenizer, "is_fast", False) else None
        backend = None if fast is None else Backend.from_str(fast.to_str())  # a copy: `hf` keeps its settings
        self._setup(backend, meta_of(hf_tokenizer, extra_eos_token_ids), lambda: hf_tokenizer)
        self.__dict__["hf"] = hf_tokenizer

    @classmethod
    def from_backend(cls, backend, meta: TokenizerMeta, load_hf) -> Tokenizer:
        """backend: a `tokenizers.Tokenizer`; load_hf: () -> transformers' tokenizer of the same model."""
        tokenizer = cls.__new__(cls)
        tokenizer._setup(backend, meta, load_hf)
        return tokenizer

    def _setup(self, backend, meta: TokenizerMeta, load_hf) -> None:
        self._backend = backend  # None (no fast tokenizer): every call through transformers' tokenizer
        self.meta = meta
        self._load_hf = load_hf
        self.eos_token_ids: list[int] = list(meta.eos_token_ids)
        self.bos_token_id: int | None = meta.bos_token_id
        self.vocab_size: int = meta.vocab_size
        if backend is not None:  # transformers turns these off per call; the api never pads or truncates
            backend.no_truncation()
            backend.no_padding()
            backend.encode_special_tokens = meta.split_special_tokens

    @functools.cached_property
    def hf(self):
        """transformers' tokenizer of this model (imports transformers: not on the api's path)."""
        return self._load_hf()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is None:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is None:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.meta.clean_up else text

    @property
    def renders_tools(self) -> bool:
        """Its chat template renders `tools` (and assistants' `tool_calls`) itself."""
        try:
            return "tools" in pick_template(self.meta.chat_template, [])
        except ValueError:
            return False

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """[{"role", "content"}, ...] -> prompt ids ending with the assistant turn's header."""
        text = render_chat(self.meta.chat_template, messages, tools, self.meta.special_tokens)
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """The tokenizer of a model name or path, one per process per resolved path."""
    return _load_resolved(resolve_model(name_or_path))


@functools.lru_cache(maxsize=4)
def _load_resolved(path: str) -> Tokenizer:
    gguf_file = find_gguf_in_dir(path) if os.path.isdir(path) else path
    if gguf_file:
        source, load_hf, extra_eos = gguf_file, lambda: load_gguf_hf_tokenizer(gguf_file, _cache_root()), []
    else:
        source, load_hf, extra_eos = path, lambda: _load_hf(path), generation_eos_ids(path)
    entry = os.path.join(_cache_root(), "tokenizers", cache_key(source))
    meta = read_meta(entry)
    if meta is not None:
        from tokenizers import Tokenizer as Backend

        return Tokenizer.from_backend(Backend.from_file(os.path.join(entry, "tokenizer.json")), meta, load_hf)
    tokenizer = Tokenizer(load_hf(), extra_eos)  # a first load of this version: transformers, then cached
    if tokenizer._backend is not None:
        _publish(entry, tokenizer.meta, tokenizer._backend)
    return tokenizer


load_tokenizer.cache_clear = _load_resolved.cache_clear  # for tests that need a cold load


def _cache_root() -> str:
    return os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")


def _publish(entry: str, meta: TokenizerMeta, backend) -> None:
    """Writes the backend and meta into the cache entry (a GGUF's entry holds transformers' save too)."""
    try:
        if os.path.isfile(os.path.join(entry, "tokenizer.json")):  # transformers' save of a GGUF: add the meta
            write_meta(entry, meta)
            return
    except OSError:
        return  # read-only home etc.: transformers at every start

    def write(staging: str) -> None:
        backend.save(os.path.join(staging, "tokenizer.json"))
        write_meta(staging, meta)

    _write_atomically(entry, write)


def _write_atomically(entry: str, write) -> None:
    """write(folder) into a staging folder, renamed to entry: readers never see a half-written
    entry; if another process published it first, or the cache is read-only, nothing changes."""
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(entry))
        write(staging)
        try:
            os.rename(staging, entry)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        pass


def _load_hf(directory: str, **kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, **kwargs)


def load_gguf_hf_tokenizer(gguf_file: str, cache_root: str | None):
    """A transformers tokenizer for a GGUF file, through the on-disk cache when possible."""
    if cache_root is None:
        return _load_hf(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    cached = os.path.join(cache_root, "tokenizers", cache_key(gguf_file))
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        return _load_hf(cached)
    tokenizer = _load_hf(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    _write_atomically(cached, tokenizer.save_pretrained)
    return tokenizer
