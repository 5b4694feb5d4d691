"""`pagedserve generate "PROMPT"`: one answer from the in-process Engine, streamed to the
terminal (chat template unless --no-chat; a trailing U+FFFD is held back until complete).
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve.shared.config import ConfigError, parse_size

log = logging.getLogger("pagedserve.generate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (a user message unless --no-chat)")
    parser.add_argument("--model", default="smollm2", help="model name or path (default: smollm2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: bfloat16 on a GPU or a CPU with AVX-512 BF16/AMX, else float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="apply the model's chat template (default: on)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV pool budget (default 256MiB)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def _check(args: argparse.Namespace) -> None:
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens={args.max_tokens}: must be at least 1")
    if args.temperature < 0:
        raise ConfigError(f"--temperature={args.temperature}: must be >= 0")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p={args.top_p}: must be in (0, 1]")
    parse_size(args.kv_cache_memory)


class TextStream:
    """Incremental detokenization for one request: feed token ids, get the new text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def feed(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""
        if not text.startswith(self.printed):  # an earlier piece changed: emit nothing twice
            return ""
        new, self.printed = text[len(self.printed):], text
        return new


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _check(args)
    except ConfigError as e:
        print(f"pagedserve generate: invalid config: {e}", file=sys.stderr)
        return 2
    from pagedserve.services.engine import Engine
    from pagedserve.shared.config import EngineConfig
    from pagedserve.shared.messages import SamplingParams

    try:
        engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                     kv_cache_memory=args.kv_cache_memory, max_num_seqs=1))
        tokenizer = engine.tokenizer
        prompt = (tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
                  else tokenizer.encode(args.prompt))
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed)
        request_id = engine.add_request(prompt, sampling)
    except ValueError as e:  # ConfigError, an unknown model, a prompt too long
        print(f"pagedserve generate: {e}", file=sys.stderr)
        return 2
    stream = TextStream(tokenizer)
    finish_reason = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id != request_id:
                continue
            final = delta.finish_reason is not None
            sys.stdout.write(stream.feed(delta.new_token_ids, final=final))
            sys.stdout.flush()
            finish_reason = delta.finish_reason or finish_reason
    sys.stdout.write("\n")
    log.info("finished (%s) after %d tokens", finish_reason, len(stream.ids))
    return 0
