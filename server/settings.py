"""Server settings: the frozen ``ServerSettings`` and the command-line flags that build it.

This module uses the standard library only, so the ``dflash2`` command can add the ``serve`` flags
without importing FastAPI.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from dflash2.config import EngineConfig

METRICS_COMPAT_CHOICES = ("vllm",)
# vLLM's --tool-call-parser names (server/tool_parsers.py implements them).
TOOL_CALL_PARSER_CHOICES = ("hermes", "llama3_json", "pythonic")
# vLLM's --reasoning-parser names (server/reasoning.py implements them).
REASONING_PARSER_CHOICES = ("deepseek_r1", "qwen3")
API_KEY_ENV = "DFLASH2_API_KEY"


@dataclass(frozen=True)
class ServerSettings:
    """Everything the HTTP layer needs at start-up.

    Attributes:
        host, port: where to listen.
        api_key: when set, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need ``Authorization: Bearer <key>``.
        served_model_name: the name clients send as ``model``; None = the engine's model name.
            The engine's own name is accepted too.
        max_concurrency: generation requests in flight (streams included) before new ones get 429.
        max_body_bytes: request bodies larger than this get 413.
        metrics_compat: ``"vllm"`` also exports the vLLM metric names and labels; None = ours only.
        drain_timeout: seconds that requests in flight get to finish after SIGTERM.
        stream_send_timeout: seconds one server-sent event may wait for a client that stopped
            reading before the stream is ended and its request aborted (frees its concurrency
            slot and KV slot); 0 = wait forever.
        tool_call_parser: the format tool calls are prompted in, parsed from and constrained to.
        timeout_keep_alive: seconds an idle keep-alive connection stays open. Above the 5 s that HTTP
            clients (httpx, the openai client) keep idle connections, so a client never sends a request on
            a connection the server is closing at that moment; above a 60 s load-balancer idle timeout too.
        default_parallel_tool_calls: ``parallel_tool_calls`` for requests that leave it out. False (as
            llama.cpp's server): a tool-call turn is one call and ends after it on any model; OpenAI's
            true only allows several, so one call is a valid reply either way.
        reasoning_parser: the thinking-block format of a reasoning model (``deepseek_r1``, ``qwen3``): its
            thinking goes to ``reasoning_content`` and grammars start after it; None = replies are all content.
        responses_store_max_entries: Responses API responses kept in memory for ``previous_response_id`` and
            ``GET /v1/responses/{id}`` (least recently used evicted first); 0 = store nothing (``store: true``
            is then served without storing, and ``previous_response_id`` is a 400).
        responses_store_max_bytes: JSON bytes the stored responses may hold together (each counts its Response
            object and every input item it was generated from).
        responses_store_ttl: seconds a stored response is kept after it was created.
        engine: the engine configuration.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_concurrency: int = 128
    max_body_bytes: int = 4 * 2**20
    metrics_compat: str | None = None
    drain_timeout: float = 30.0
    stream_send_timeout: float = 60.0
    timeout_keep_alive: float = 65.0
    tool_call_parser: str = "hermes"
    default_parallel_tool_calls: bool = False
    reasoning_parser: str | None = None
    responses_store_max_entries: int = 10_000
    responses_store_max_bytes: int = 256 * 2**20
    responses_store_ttl: float = 3600.0
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be at least 1")
        if self.metrics_compat not in (None, *METRICS_COMPAT_CHOICES):
            raise ValueError(f"metrics_compat must be one of {', '.join(METRICS_COMPAT_CHOICES)}")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be non-negative")
        if self.stream_send_timeout < 0:
            raise ValueError("stream_send_timeout must be non-negative")
        if self.timeout_keep_alive <= 0:
            raise ValueError("timeout_keep_alive must be positive")
        if self.tool_call_parser not in TOOL_CALL_PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSER_CHOICES)}")
        if self.reasoning_parser not in (None, *REASONING_PARSER_CHOICES):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_CHOICES)}")
        if self.responses_store_max_entries < 0:
            raise ValueError("responses_store_max_entries must be non-negative (0 disables the store)")
        if self.responses_store_max_bytes < 1:
            raise ValueError("responses_store_max_bytes must be at least 1")
        if not self.responses_store_ttl > 0:
            raise ValueError("responses_store_ttl must be positive")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")


_DEFAULTS = ServerSettings()


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """HTTP flags of ``dflash2 serve`` / ``python -m server`` (defaults from ``ServerSettings``)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=_DEFAULTS.host, help="address to listen on (0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, default=_DEFAULTS.port)
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (default: ${API_KEY_ENV})",
    )
    g.add_argument("--served-model-name", default=_DEFAULTS.served_model_name, help="model name shown to clients")
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=_DEFAULTS.max_concurrency,
        help="generation requests in flight before new ones get 429",
    )
    g.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes, help="larger request bodies get 413")
    g.add_argument(
        "--metrics-compat",
        choices=METRICS_COMPAT_CHOICES,
        default=_DEFAULTS.metrics_compat,
        help="also export metrics under these names and labels (vllm: vllm:* with model_name and engine)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=_DEFAULTS.drain_timeout,
        help="seconds requests in flight get to finish after SIGTERM",
    )
    g.add_argument(
        "--stream-send-timeout",
        type=float,
        default=_DEFAULTS.stream_send_timeout,
        help="seconds a streamed event may wait for a client that stopped reading before the stream ends and its "
        "request is aborted (0: wait forever; default: %(default)s)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=_DEFAULTS.timeout_keep_alive,
        help="seconds an idle keep-alive connection stays open (above clients' own idle limit; default: %(default)s)",
    )
    g.add_argument(
        "--wait-for-compile",
        dest="background_compile",
        action="store_false",
        help="compile the decode forwards before the server turns ready, as `generate` does (default: ready at "
        "once with the eager forwards while a low-priority background process compiles them; the compiled "
        "graphs come into use between two steps once built)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSER_CHOICES,
        default=_DEFAULTS.tool_call_parser,
        help="tool-call format: hermes (<tool_call>{json}</tool_call>), llama3_json or pythonic",
    )
    g.add_argument(
        "--default-parallel-tool-calls",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.default_parallel_tool_calls,
        help="parallel_tool_calls for requests that do not set it (default: off, as llama.cpp: a tool-call turn "
        "is one call and ends after it; with it on, a turn of calls ends before a call that repeats one)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSER_CHOICES,
        default=_DEFAULTS.reasoning_parser,
        help="a reasoning model's thinking-block format: its <think>…</think> text goes to reasoning_content and "
        "grammars (tools, response_format) start after it (default: none, replies are all content)",
    )
    g.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=_DEFAULTS.responses_store_max_entries,
        help="Responses API responses kept in memory for previous_response_id and GET /v1/responses/{id}, least "
        "recently used evicted first (0: store nothing; store: true is then served without storing; "
        "default: %(default)s)",
    )
    g.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=_DEFAULTS.responses_store_max_bytes,
        help="JSON bytes the stored responses may hold together, each counting its input items (default: %(default)s)",
    )
    g.add_argument(
        "--responses-store-ttl",
        type=float,
        default=_DEFAULTS.responses_store_ttl,
        help="seconds a stored response is kept after it was created (default: %(default)s)",
    )


def settings_from_args(args: argparse.Namespace, engine: EngineConfig) -> ServerSettings:
    """Build ``ServerSettings`` from parsed flags and an engine configuration."""
    return ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_name=args.served_model_name,
        max_concurrency=args.max_concurrency,
        max_body_bytes=args.max_body_bytes,
        metrics_compat=args.metrics_compat,
        drain_timeout=args.drain_timeout,
        stream_send_timeout=args.stream_send_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
        tool_call_parser=args.tool_call_parser,
        default_parallel_tool_calls=args.default_parallel_tool_calls,
        reasoning_parser=args.reasoning_parser,
        responses_store_max_entries=args.responses_store_max_entries,
        responses_store_max_bytes=args.responses_store_max_bytes,
        responses_store_ttl=args.responses_store_ttl,
        engine=engine,
    )
