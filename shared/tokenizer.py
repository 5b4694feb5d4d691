"""The model's tokenizer: text <-> token ids and the chat template, for api and tests.

A GGUF tokenizer is cached under $PAGEDSERVE_CACHE_DIR/tokenizers (skipped if unwritable).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile

from pagedserve.shared.model_source import find_gguf_in_dir, resolve_model


class Tokenizer:
    def __init__(self, hf_tokenizer, extra_eos_token_ids: list[int] | tuple[int, ...] = ()):
        self.hf = hf_tokenizer
        eos = [] if hf_tokenizer.eos_token_id is None else [int(hf_tokenizer.eos_token_id)]
        for token_id in extra_eos_token_ids:
            if int(token_id) not in eos:
                eos.append(int(token_id))
        self.eos_token_ids: list[int] = eos  # the tokenizer's eos first, then generation_config's
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)  # includes added special tokens
        # decode through the Rust tokenizer: the HF wrapper adds only Python overhead per token
        backend = getattr(hf_tokenizer, "backend_tokenizer", None) if getattr(hf_tokenizer, "is_fast", False) else None
        self._backend = backend if backend is not None and not hf_tokenizer.clean_up_tokenization_spaces else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """Its chat template renders `tools` (and assistants' `tool_calls`) itself."""
        return "tools" in (self.hf.chat_template or "")

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """[{"role", "content"}, ...] -> prompt ids ending with the assistant turn's header."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        return list(self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                return_dict=False))


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """The tokenizer of a model name or path, one per process per resolved path."""
    return _load_resolved(resolve_model(name_or_path))


@functools.lru_cache(maxsize=4)
def _load_resolved(path: str) -> Tokenizer:
    gguf_file = find_gguf_in_dir(path) if os.path.isdir(path) else path
    if gguf_file:
        return Tokenizer(load_gguf_hf_tokenizer(gguf_file, _cache_root()))
    return Tokenizer(_load_hf(path), _generation_eos_ids(path))


load_tokenizer.cache_clear = _load_resolved.cache_clear  # for tests that need a cold load


def _cache_root() -> str:
    return os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")


def _load_hf(directory: str, **kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, **kwargs)


def _generation_eos_ids(directory: str) -> list[int]:
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


def load_gguf_hf_tokenizer(gguf_file: str, cache_root: str | None):
    """A transformers tokenizer for a GGUF file, through the on-disk cache when possible."""
    if cache_root is None:
        return _load_hf(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    stat = os.stat(gguf_file)
    key = hashlib.sha256(f"{os.path.realpath(gguf_file)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    cached = os.path.join(cache_root, "tokenizers", key[:24])
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return _load_hf(cached)
    tokenizer = _load_hf(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(cached))
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, cached)  # atomic: readers never see a half-written cache entry
        except OSError:  # another process published it first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        pass  # read-only home etc.: run uncached
    return tokenizer
