"""The checks a tokenized prompt and its max_tokens pass before they are served, pure: the api's
edge turns a failure into a 400, the in-process engine raises it (a ValueError)."""

from __future__ import annotations


class PromptRejected(ValueError):
    def __init__(self, message: str, param: str, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def check_prompt(prompt_ids: list[int], vocab_size: int) -> None:
    if not prompt_ids:
        raise PromptRejected("the prompt is empty", "prompt", "empty_prompt")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise PromptRejected(f"prompt token id {bad[0]} is out of vocabulary (ids 0..{vocab_size - 1})", "prompt")


def check_context(num_prompt: int, max_tokens: int, max_model_len: int, prompt_field: str = "prompt") -> None:
    if num_prompt >= max_model_len:
        verb = "have" if prompt_field == "messages" else "has"  # "the messages alone have", "the prompt alone has"
        raise PromptRejected(f"this model's maximum context length is {max_model_len} tokens; the {prompt_field} "
                             f"alone {verb} {num_prompt} tokens", prompt_field, "context_length_exceeded")
    if num_prompt + max_tokens > max_model_len:
        raise PromptRejected(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                             f"{num_prompt} tokens and max_tokens asks for {max_tokens} more", "max_tokens",
                             "context_length_exceeded")
    if max_tokens < 1:
        raise PromptRejected(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
