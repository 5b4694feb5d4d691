"""A parsed body -> the ApiRequest it asks for (prompt token ids, SamplingParams, stop strings):
the one place client input is checked, before anything is sent, so a rejected request changes
nothing; nothing deeper checks it again."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

from pagedserve.services.api.admission import RequestLimits, check_limits
from pagedserve.services.api.echo import isolated_salt, prompt_echo
from pagedserve.services.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from pagedserve.services.api.request import ApiRequest
from pagedserve.services.api.structured_outputs import BODY_FIELDS, guided_decoding
from pagedserve.services.api.tool_calls import ToolUse, template_messages, tool_use
from pagedserve.shared.messages import SamplingParams
from pagedserve.shared.prompt_check import PromptRejected, check_context, check_prompt

DEFAULT_COMPLETION_MAX_TOKENS = 16  # as OpenAI
DEFAULT_CHAT_MAX_TOKENS = 1024  # chat: the rest of the context, capped at this
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_N = 16  # choices per request (one prefill, n forks)
MAX_CACHE_SALT_CHARS = 256
_INT64 = (-(2**63), 2**63 - 1)
NO_LIMITS = RequestLimits()
_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass
class ModelInfo:
    served_name: str
    max_model_len: int
    vocab_size: int
    aliases: set[str] = field(default_factory=set)  # lower-cased names also accepted
    # generation_config.json's values for fields a request omits (shared/generation_defaults.py)
    sampling_defaults: dict = field(default_factory=dict)

    def accepts(self, name: str | None) -> bool:
        return name is None or name == self.served_name or name.lower() in self.aliases


def prepare(body: CompletionRequest | ChatCompletionRequest, tokenizer, info: ModelInfo,
            limits: RequestLimits = NO_LIMITS, tenant: str | None = None, max_n: int = MAX_N) -> ApiRequest:
    """Validate and tokenize; raises ApiError for any bad input. tenant: the caller's (its API
    key's) unless the body names a user; max_n: the most choices (`n`) the calling route serves."""
    if not info.accepts(body.model):
        raise ApiError(404, f"the model '{body.model}' does not exist (this server serves '{info.served_name}')",
                       code="model_not_found", param="model")
    _check_unsupported(body, max_n)
    guided = guided_decoding(body) if any(getattr(body, name, None) is not None for name in BODY_FIELDS) else None
    tools, tool_guide = tool_use(body) if isinstance(body, ChatCompletionRequest) else (None, None)
    if tool_guide is not None:
        if guided is not None:
            raise ApiError(400, "tool_choice 'required', a named function or strict tools cannot be combined "
                           "with a structured output", param="tool_choice")
        guided = tool_guide
    if isinstance(body, ChatCompletionRequest):
        prompt_ids = _chat_prompt(body, tokenizer, tools)
        kind, max_tokens = "chat", body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        default_max = min(DEFAULT_CHAT_MAX_TOKENS, info.max_model_len - len(prompt_ids))
        logprobs = _chat_logprobs(body)
    else:
        prompt_ids = _completion_prompt(body, tokenizer)
        kind, max_tokens, default_max = "completion", body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS
        logprobs = _bounded(body.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)
    _checked(check_prompt, prompt_ids, info.vocab_size)
    default_max = min(default_max, info.sampling_defaults.get("max_tokens", default_max))  # max_new_tokens
    asks_prompt = body.prompt_logprobs is not None or (isinstance(body, CompletionRequest) and body.echo)
    prompt = prompt_echo(body, prompt_ids, logprobs, tokenizer) if asks_prompt else None
    if max_tokens is not None and max_tokens < 1 and not (prompt and prompt.drop_output):
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens} (0 only with echo)",
                       param="max_tokens")
    max_tokens = default_max if max_tokens is None else max(max_tokens, 1)  # echo's 0: one sampled, dropped
    prompt_field = "messages" if kind == "chat" else "prompt"
    _checked(check_context, len(prompt_ids), max_tokens, info.max_model_len, prompt_field)
    sampling = _sampling(body, max_tokens, logprobs, info)
    sampling.guided, sampling.speculative_decoding = guided, body.speculative_decoding
    sampling.min_tokens = _bounded(body.min_tokens, "min_tokens", 0, max_tokens)
    if sampling.min_tokens and guided is not None:
        raise ApiError(400, "min_tokens cannot be used with a structured output or constrained tools: the output "
                       "ends where the grammar does", param="min_tokens")
    stop, priority, cache_salt = _stop_strings(body.stop), _bounded(body.priority, "priority", *_INT64), \
        _cache_salt(body.cache_salt)
    check_limits(limits, len(prompt_ids), max_tokens, prompt_field)
    if prompt is not None and prompt.num_top is not None:
        sampling.prompt_logprobs, cache_salt = prompt.num_top, isolated_salt(cache_salt)
    options = body.stream_options
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    return ApiRequest(kind=kind, model=info.served_name, request_id=request_id, prompt_token_ids=prompt_ids,
                      sampling=sampling, stop=stop, priority=priority, tenant=body.user if body.user is not None else tenant,
                      cache_salt=cache_salt, stream=body.stream, tool_use=tools, prompt=prompt,
                      include_usage=bool(options and options.include_usage),
                      continuous_usage=bool(options and options.continuous_usage_stats))


def _check_unsupported(body, max_n: int) -> None:
    if body.n < 1:
        raise ApiError(400, f"n must be at least 1, got {body.n}", param="n", code="invalid_value")
    if body.n > max_n:
        where = "on this route" if max_n == 1 else f"above {max_n}"
        raise ApiError(400, f"n={body.n} is not supported {where}", param="n",
                       code="unsupported" if max_n == 1 else "invalid_value")
    if body.seed is not None and body.n > 1 and body.seed + body.n - 1 > _INT64[1]:
        raise ApiError(400, f"seed + n - 1 must fit in int64 (choice i samples with seed + i), got seed={body.seed}",
                       param="seed")
    if isinstance(body, CompletionRequest):
        if body.best_of not in (None, 1):
            raise ApiError(400, "best_of other than 1 is not supported yet", param="best_of", code="unsupported")
        if body.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported")


def _completion_prompt(body: CompletionRequest, tokenizer) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise ApiError(400, "a list of several prompts is served on /v1/completions only: send one here",
                           param="prompt", code="unsupported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt) if prompt else []
    return list(prompt)


def _checked(check, *args) -> None:
    try:
        check(*args)
    except PromptRejected as e:
        raise ApiError(400, e.message, code=e.code, param=e.param) from None


def _chat_prompt(body: ChatCompletionRequest, tokenizer, tools: ToolUse | None) -> list[int]:
    if not body.messages:
        raise ApiError(400, "messages is empty: send at least one message", code="empty_prompt", param="messages")
    messages = []
    for i, m in enumerate(body.messages):
        if m.role not in _CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role {m.role!r} is not one of {sorted(_CHAT_ROLES)}",
                           param="messages")
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": _content(m.content, i)})
    if not any(m["content"] for m in messages):
        raise ApiError(400, "every message is empty", code="empty_prompt", param="messages")
    messages, tool_list = template_messages(messages, body, tools, tokenizer.renders_tools)
    try:
        return tokenizer.apply_chat_template(messages, tools=tool_list)
    except Exception as e:  # a template that rejects the conversation (e.g. role order) is bad input
        raise ApiError(400, f"the chat template rejected these messages: {e}", param="messages") from None


def _content(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                           param="messages", code="unsupported")
        parts.append(part.text)
    return "".join(parts)


def _chat_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if not body.logprobs:
        return None
    return _bounded(body.top_logprobs or 0, "top_logprobs", 0, MAX_TOP_LOGPROBS)


def _sampling(body, max_tokens: int, logprobs: int | None, info: ModelInfo) -> SamplingParams:
    defaults = info.sampling_defaults
    temperature = defaults.get("temperature", 1.0) if body.temperature is None else body.temperature
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ApiError(400, f"temperature must be a finite number >= 0, got {temperature}", param="temperature")
    top_p = defaults.get("top_p", 1.0) if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = defaults.get("top_k", 0) if body.top_k is None else body.top_k
    top_k = 0 if top_k == -1 else _bounded(top_k, "top_k", 0, info.vocab_size)
    min_p = defaults.get("min_p", 0.0) if body.min_p is None else body.min_p
    if not 0 <= min_p <= 1:
        raise ApiError(400, f"min_p must be in [0, 1], got {min_p}", param="min_p")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name) or 0.0
        if not -2 <= value <= 2:
            raise ApiError(400, f"{name} must be in [-2, 2], got {value}", param=name)
        penalties[name] = value
    repetition = defaults.get("repetition_penalty", 1.0) if body.repetition_penalty is None \
        else body.repetition_penalty
    if not 0 < repetition <= 2:
        raise ApiError(400, f"repetition_penalty must be in (0, 2], got {repetition}", param="repetition_penalty")
    stop_ids = list(body.stop_token_ids or [])
    bad = [t for t in stop_ids if not 0 <= t < info.vocab_size]
    if bad:
        raise ApiError(400, f"stop_token_ids: {bad[0]} is out of range [0, {info.vocab_size})",
                       param="stop_token_ids")
    seed = None if body.seed is None else _bounded(body.seed, "seed", *_INT64)
    logit_bias = _logit_bias(body.logit_bias, info.vocab_size)
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                          min_p=float(min_p), seed=seed, stop_token_ids=stop_ids, ignore_eos=body.ignore_eos,
                          logprobs=logprobs, repetition_penalty=float(repetition),
                          presence_penalty=float(penalties["presence_penalty"]),
                          frequency_penalty=float(penalties["frequency_penalty"]), n=body.n,
                          logit_bias=logit_bias)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's {"token id": bias}: ids in the vocabulary, biases in [-100, 100]."""
    out = {}
    for key, value in (bias or {}).items():
        token_id = int(key) if key.strip().lstrip("-").isdigit() else None
        if token_id is None or not 0 <= token_id < vocab_size:
            raise ApiError(400, f"logit_bias: token id {key!r} is not in the vocabulary [0, {vocab_size})",
                           param="logit_bias")
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise ApiError(400, f"logit_bias: the bias of token {key} must be in [-100, 100], got {value}",
                           param="logit_bias")
        out[token_id] = float(value)
    return out


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return [s for s in stops if s]


def _cache_salt(salt: str | None) -> str:
    if salt is None:
        return ""
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                       f"got {len(salt)}", param="cache_salt")
    return salt


def _bounded(value: int | None, name: str, low: int, high: int) -> int | None:
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"{name} must be in [{low}, {high}], got {value}", param=name)
    return value
