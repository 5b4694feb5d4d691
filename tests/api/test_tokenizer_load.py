"""The api's tokenizer from the cache: `tokenizers` and jinja2 only (no transformers, no torch in
the process), with the same ids, text and chat prompts as transformers' tokenizer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.shared.tokenizer import Tokenizer, load_tokenizer
from pagedserve.shared.tokenizer_meta import META_FILE
from tests.gpu_worker.family_tokenizers import build_tokenizer

SMOLLM2_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <|im_end|> wörld 🎉"},
            {"role": "assistant", "content": "Hi.", "tool_calls": None}, {"role": "user", "content": "2 + 2?"}]
# what transformers' sandbox gives a template: the generation tag, namespace, dict, tojson, loop controls
FEATURES = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
            "{% set ns.n = ns.n + 1 %}{{ bos_token }}{{ m['role'] }}:{% generation %}{{ m['content'] }}{% endgeneration %}"
            "{{ eos_token }}{% endfor %}{% if tools %}{{ tools | tojson(indent=1) }}{{ dict(a=1) | tojson }}{% endif %}"
            "{{ ns.n }}{% if add_generation_prompt %}assistant:{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Météo <b>", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _expected(hf, messages, tools=None):
    return list(hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    load_tokenizer.cache_clear()
    yield tmp_path / "cache"
    load_tokenizer.cache_clear()


def _cached_load(source: str) -> Tokenizer:
    """A load that finds the cache entry a first load wrote (a later start's path)."""
    load_tokenizer.cache_clear()
    load_tokenizer(source)
    load_tokenizer.cache_clear()
    tokenizer = load_tokenizer(source)
    assert "hf" not in tokenizer.__dict__  # served without transformers' tokenizer
    return tokenizer


@pytest.mark.parametrize("style", ["qwen", "llama3"])
def test_a_folders_cached_tokenizer_matches_transformers(cache, tmp_path, style):
    hf = build_tokenizer(style)
    hf.save_pretrained(tmp_path / "model")
    tokenizer = _cached_load(str(tmp_path / "model"))
    (entry,) = os.listdir(cache / "tokenizers")
    assert sorted(os.listdir(cache / "tokenizers" / entry)) == [META_FILE, "tokenizer.json"]
    messages = [m for m in MESSAGES if "tool_calls" not in m]
    assert tokenizer.apply_chat_template(messages) == _expected(hf, messages)
    assert tokenizer.apply_chat_template(messages[1:2]) == _expected(hf, messages[1:2])
    assert (tokenizer.eos_token_ids, tokenizer.bos_token_id, tokenizer.vocab_size) == (
        [hf.eos_token_id], hf.bos_token_id, len(hf))


def test_a_changed_folder_is_read_again(cache, tmp_path):
    build_tokenizer("qwen").save_pretrained(tmp_path / "model")
    _cached_load(str(tmp_path / "model"))
    llama3 = build_tokenizer("llama3")
    llama3.save_pretrained(tmp_path / "model")
    tokenizer = _cached_load(str(tmp_path / "model"))
    assert len(os.listdir(cache / "tokenizers")) == 2
    assert tokenizer.apply_chat_template(MESSAGES[1:2]) == _expected(llama3, MESSAGES[1:2])


@pytest.mark.parametrize("named", [False, True])
def test_template_features_and_tools_as_transformers_renders_them(cache, tmp_path, named):
    hf = build_tokenizer("llama3")
    hf.chat_template = {"default": "{{ 'plain' }}", "tool_use": FEATURES} if named else FEATURES
    hf.save_pretrained(tmp_path / "model")
    tokenizer = _cached_load(str(tmp_path / "model"))
    assert tokenizer.renders_tools
    assert tokenizer.apply_chat_template(MESSAGES, tools=TOOLS) == _expected(hf, MESSAGES, TOOLS)
    if not named:
        assert tokenizer.apply_chat_template(MESSAGES) == _expected(hf, MESSAGES)
    reasoning = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning": "think"}]
    hf.chat_template = "{% for m in messages %}{{ m['thinking'] }},{{ m['reasoning_content'] }};{% endfor %}"
    assert Tokenizer(hf).apply_chat_template(reasoning) == _expected(hf, reasoning)


@pytest.fixture(scope="module")
def smollm2():
    """transformers' SmolLM2 tokenizer and ours read back from a cache entry."""
    hf = load_tokenizer("smollm2").hf
    return hf, Tokenizer.from_backend(*_backend_and_meta(hf))


def _backend_and_meta(hf):
    from tokenizers import Tokenizer as Backend

    from pagedserve.shared.tokenizer_meta import meta_of

    return Backend.from_str(hf.backend_tokenizer.to_str()), meta_of(hf), lambda: hf


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.one_of(st.text(max_size=12), st.sampled_from([*SMOLLM2_SPECIALS, " ", "\n", "  x"])),
                      max_size=8), skip=st.booleans())
def test_smollm2_ids_and_text_equal_transformers(smollm2, parts, skip):
    hf, tokenizer = smollm2
    text = "".join(parts)
    ids = tokenizer.encode(text)
    assert ids == hf.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "user", "content": text}]
    assert tokenizer.apply_chat_template(messages) == _expected(hf, messages)


@pytest.mark.slow
def test_a_warm_api_process_imports_neither_transformers_nor_torch(cache):
    load_tokenizer("smollm2")  # the first load writes the cache entry
    script = ("import sys; from pagedserve.shared.tokenizer import load_tokenizer; import pagedserve.services.api.main;"
              "t = load_tokenizer('smollm2'); assert t.apply_chat_template([{'role': 'user', 'content': 'hi'}]);"
              "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PAGEDSERVE_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
