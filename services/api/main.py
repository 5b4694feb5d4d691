"""Entry point of the api service: `python -m pagedserve.services.api.main [options]`.

Bad config exits 2 naming the option; Redis down at start is retried in the background.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import logging
import os
import signal
import socket
import sys

from pagedserve.services.api.app import ApiConfig, create_app
from pagedserve.services.api.inputs import ModelInfo
from pagedserve.shared import redis_io
from pagedserve.shared.generation_defaults import generation_defaults
from pagedserve.shared.model_source import SMOLLM2_NAMES, resolve_model, smollm2_gguf_path
from pagedserve.shared.redis_connect import check_redis_url

log = logging.getLogger("pagedserve.api")


class ConfigError(ValueError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="smollm2", help="model name or path (tokenizer, context length)")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    parser.add_argument("--api-key", default=env("PAGEDSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 and /admin (env PAGEDSERVE_API_KEY)")
    parser.add_argument("--redis-url", default=env("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--prefix", default=env("PAGEDSERVE_PREFIX", "pagedserve"), help="Redis key prefix")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (413 above)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="per-request limit: longer prompts get 400 naming it (default: the context)")
    parser.add_argument("--max-output-tokens", type=int, default=None,
                        help="per-request limit: a larger max_tokens gets 400 naming it (default: the context)")
    parser.add_argument("--log-level", default=env("PAGEDSERVE_LOG_LEVEL", "info").lower(), type=str.lower,
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn)")
    parser.add_argument("--api-id", default=env("PAGEDSERVE_API_ID"),
                        help="this replica's id, kept across restarts so it finds its requests again "
                             "(default: <hostname>-<port>)")
    parser.add_argument("--record-ttl", type=int, default=3600,
                        help="seconds a request record stays in Redis after its last write (default 3600)")
    parser.add_argument("--reuse-port", action="store_true",
                        help="bind with SO_REUSEPORT, so several replicas serve one port")


def config_from_args(args: argparse.Namespace) -> ApiConfig:
    """ApiConfig from parsed options; ConfigError naming the option for a bad value."""
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port={args.port}: must be in 1..65535")
    if args.max_body_bytes < 1024:
        raise ConfigError(f"--max-body-bytes={args.max_body_bytes}: must be at least 1024")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ConfigError(f"--max-model-len={args.max_model_len}: must be at least 2")
    for name in ("max_prompt_tokens", "max_output_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    check_redis_url(args.redis_url)
    if not args.prefix or any(c.isspace() for c in args.prefix):
        raise ConfigError(f"--prefix={args.prefix!r}: must be non-empty without spaces")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key: must not be empty")
    if args.record_ttl < 1:
        raise ConfigError(f"--record-ttl={args.record_ttl}: must be at least 1 second")
    api_id = args.api_id or f"{socket.gethostname()}-{args.port}"
    if not api_id or any(c.isspace() or c == ":" for c in api_id):
        raise ConfigError(f"--api-id={api_id!r}: must be non-empty without spaces or ':'")
    try:
        resolve_model(args.model)
    except ValueError as e:
        raise ConfigError(f"--model={args.model!r}: {e}") from None
    return ApiConfig(model=args.model, served_model_name=args.served_model_name, redis_url=args.redis_url,
                     prefix=args.prefix, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     max_prompt_tokens=args.max_prompt_tokens,
                     max_output_tokens=args.max_output_tokens, api_id=api_id, record_ttl_s=args.record_ttl)


def load_model_info(config: ApiConfig, tokenizer, max_model_len: int | None = None) -> ModelInfo:
    """Served name, aliases, context length (max_model_len, --max-model-len, else the model's
    max_position_embeddings): the api's one source of it."""
    path = resolve_model(config.model)
    max_len = max_model_len or _context_length(path)
    aliases = {config.model.lower(), config.served_name.lower()}
    if _is_smollm2(path):
        aliases |= {n.lower() for n in SMOLLM2_NAMES}
    defaults = generation_defaults(path)
    if defaults:  # as vLLM says it: a request's omitted fields take these
        log.info("default sampling parameters from the model's generation_config.json: %s", defaults)
    return ModelInfo(served_name=config.served_name, max_model_len=max_len, vocab_size=tokenizer.vocab_size,
                     aliases=aliases, sampling_defaults=defaults)


def _is_smollm2(path: str) -> bool:
    try:
        return os.path.realpath(path) == os.path.realpath(smollm2_gguf_path())
    except ValueError:
        return False


def _context_length(path: str) -> int:
    from pagedserve.shared.model_config import ModelConfig
    from pagedserve.shared.model_reader import hf_dir_config

    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return hf_dir_config(path).max_position_embeddings
    from gguf import GGUFReader

    from pagedserve.shared.model_source import find_gguf_in_dir
    from pagedserve.shared.tokenizer import _cache_root as cache_root

    gguf_file = find_gguf_in_dir(path) if os.path.isdir(path) else path
    # the header's parse takes seconds (the vocabulary is in it): its answer is kept per file version
    stat = os.stat(gguf_file)
    key = hashlib.sha256(f"{os.path.realpath(gguf_file)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    cached = os.path.join(cache_root(), "context_lengths", key[:24])
    with contextlib.suppress(OSError, ValueError):
        with open(cached) as f:
            return int(f.read())
    length = ModelConfig.from_gguf(GGUFReader(gguf_file)).max_position_embeddings
    with contextlib.suppress(OSError):  # read-only home etc.: parse at every start
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        with open(f"{cached}.{os.getpid()}", "w") as f:
            f.write(str(length))
        os.replace(f"{cached}.{os.getpid()}", cached)
    return length


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"pagedserve api: invalid config: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from pagedserve.shared.tokenizer import load_tokenizer

    try:  # first, so a busy port fails in a second, not after loading the tokenizer
        sock = bind_socket(args.host, args.port, args.reuse_port)
    except OSError as e:
        print(f"pagedserve api: cannot listen on {args.host}:{args.port}: {e.strerror or e}"
              f"{' (is another server running there?)' if e.errno == errno.EADDRINUSE else ''}", file=sys.stderr)
        return 3

    tokenizer = load_tokenizer(config.model)
    info = load_model_info(config, tokenizer, args.max_model_len)
    app = create_app(config, tokenizer, info)
    log.info("api listening on http://%s:%d (model %s, auth %s)", args.host, args.port, info.served_name,
             "on" if config.api_key else "off")
    redis_io.settle_gc()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=args.access_log, ws_max_size=2 * config.max_body_bytes,
                                           timeout_graceful_shutdown=5))
    # uvicorn re-raises the stop signal on itself after a clean shutdown; keep exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    return 0


def bind_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening socket; OSError (EADDRINUSE: the port is taken) if it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve api", description="pagedserve HTTP/WebSocket api")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
