"""What the api needs of a transformers tokenizer besides its backend (tokenizer.json): special
tokens, eos ids, the chat template, decode clean-up; taken once from transformers and kept beside
the backend in the tokenizer cache entry, so later starts never import transformers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

META_FILE = "pagedserve_tokenizer.json"
FORMAT = 1  # bump when the fields or their meaning change: older entries are rebuilt
_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5")


@dataclasses.dataclass(frozen=True)
class TokenizerMeta:
    eos_token_ids: list[int]  # the tokenizer's eos first, then generation_config's
    bos_token_id: int | None
    vocab_size: int  # len(tokenizer): the base vocabulary and the added tokens
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: the chat template's variables
    chat_template: str | dict | None  # a dict: named templates ("default", "tool_use")
    clean_up: bool  # decode applies transformers' clean_up_tokenization
    split_special_tokens: bool  # special tokens' text in input encodes as ordinary text


def meta_of(hf, extra_eos_token_ids=()) -> TokenizerMeta:
    """The meta of a transformers tokenizer, with generation_config's eos ids after its own."""
    eos = [] if hf.eos_token_id is None else [int(hf.eos_token_id)]
    for token_id in extra_eos_token_ids:
        if int(token_id) not in eos:
            eos.append(int(token_id))
    backend = getattr(hf, "backend_tokenizer", None)
    bpe = backend is not None and type(backend.model).__name__ == "BPE"
    forced = getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return TokenizerMeta(
        eos_token_ids=eos, bos_token_id=hf.bos_token_id, vocab_size=len(hf),
        special_tokens={k: str(v) for k, v in hf.special_tokens_map.items()},
        chat_template=hf.chat_template,
        clean_up=bool(hf.clean_up_tokenization_spaces) and (not bpe or bool(forced)),
        split_special_tokens=bool(getattr(hf, "split_special_tokens", False)))


def read_meta(entry: str) -> TokenizerMeta | None:
    """The entry's meta, or None when it has none, an older format or no backend beside it."""
    try:
        with open(os.path.join(entry, META_FILE)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if data.pop("format", None) != FORMAT or not os.path.isfile(os.path.join(entry, "tokenizer.json")):
        return None
    try:
        return TokenizerMeta(**data)
    except TypeError:
        return None


def write_meta(entry: str, meta: TokenizerMeta) -> None:
    """Atomically (a reader sees the whole file or none); OSError if the entry is unwritable."""
    tmp = os.path.join(entry, f".{META_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, **dataclasses.asdict(meta)}, f)
    os.replace(tmp, os.path.join(entry, META_FILE))


def cache_key(source: str) -> str:
    """A GGUF file or HF folder's version: its path and the size and mtime of its files (not weights)."""
    real = os.path.realpath(source)
    if os.path.isdir(real):
        parts = [real]
        for name in sorted(os.listdir(real)):
            path = os.path.join(real, name)
            if os.path.isfile(path) and not name.endswith(_WEIGHTS):
                stat = os.stat(path)
                parts.append(f"{name}|{stat.st_size}|{stat.st_mtime_ns}")
        text = "\n".join(parts)
    else:
        stat = os.stat(real)
        text = f"{real}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def generation_eos_ids(directory: str) -> list[int]:
    """generation_config.json's eos_token_id (one or a list), [] without one."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text
