"""``kvroom serve OUT``: an OpenAI-compatible HTTP server over an artifact.

Start-up, in order: bind the address (a taken port fails in a second, before the model loads),
size the pool by the start-up override policy (``LLM(path, kvcache_num_blocks=...)``, the same
``replan`` as ``run`` and ``set``), write the chosen size back only with ``--persist`` (the
atomic ``set_kvcache_num_blocks``), log the KV line (once, as the runtime loads), print the
address, serve until SIGTERM.

``--engine vllm`` plans the same way, then hands the pool to ``vllm serve`` and checks vLLM's
own KV line against the plan (``cli/vllm_command.serve_with_vllm``).
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

from kvroom.cli.live_pool_options import add_live_pool_flags, open_llm
from kvroom.cli.multi_serve import add_multi_flags, open_models, single_artifact
from kvroom.cli.options import (
    add_prefix_caching_flag,
    add_startup_flags,
    add_tool_call_flags,
    startup_overrides,
    tool_options,
)
from kvroom.cli.vllm_command import add_vllm_serve_flags, launch_for, serve_with_vllm
from kvroom.errors import ConfigError


def add_serve_command(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve one artifact, or several under one memory budget, over an "
        "OpenAI-compatible HTTP API",
    )
    p.add_argument(
        "artifact",
        nargs="+",
        help="artifact folder; several: one server routes by the request's model, the pools "
        "share --memory-budget",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    p.add_argument(
        "--engine",
        choices=("kvroom", "vllm"),
        default="kvroom",
        help="kvroom's own runtime (default), or `vllm serve` given exactly the planned pool",
    )
    add_startup_flags(p, elastic=True)
    add_prefix_caching_flag(p)
    p.add_argument(
        "--persist",
        action="store_true",
        help="write the chosen kvcache_num_blocks into the artifact (atomic, like `kvroom set`); "
        "without it the artifact is not changed",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="model name clients send (default: the artifact path as given); several "
        "artifacts: once per artifact, in order",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $KVROOM_API_KEY, else none)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="refuse larger request bodies with a 413 (default 32 MiB)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take to finish after SIGTERM before they are "
        "aborted (default 30)",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log one line per HTTP request (default on)",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="image_url parts may name local files under DIR (default: none; http(s) URLs "
        "are always refused)",
    )
    add_tool_call_flags(p)
    add_live_pool_flags(p)
    add_multi_flags(p)
    add_vllm_serve_flags(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if len(args.artifact) > 1:
        return cmd_serve_many(args)
    single_artifact(args)
    if args.engine == "vllm":
        return cmd_serve_vllm(args)
    given = [f for f in ("vllm_python", "vllm_block_size", "vllm_pool") if getattr(args, f)]
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise ConfigError(f"{flags}: only used with --engine vllm")
    tools = tool_options(args)
    sock = bind_socket(args.host, args.port)  # before the slow imports: fail fast
    try:
        from kvroom.server.app import create_app
        from kvroom.server.lifecycle import serve

        llm, elastic = open_llm(args.artifact, startup_overrides(args), args)
        plan = llm.runtime.plan
        note = persist(args.artifact, plan.num_blocks) if args.persist else "artifact unchanged"
        app = create_app(
            llm,
            served_model_name=args.served_model_name or args.artifact,
            allowed_local_media_path=args.allowed_local_media_path,
            admin_key=args.admin_key,
            elastic=elastic,
            tool_options=tools,
            **_http_options(args),
        )
        host, port = sock.getsockname()[:2]
        _say(f"kvcache_num_blocks={plan.num_blocks} ({note})")  # the KV line was logged at load
        _say(f"serving {args.artifact} on {_url(host, port)} (OpenAI API under /v1)")
        serve(app, sock, access_log=args.access_log, shutdown_timeout_s=args.shutdown_timeout)
    finally:
        sock.close()
    _say("server stopped")
    return 0


def cmd_serve_many(args: argparse.Namespace) -> int:
    """Several artifacts: load each with its share of the budget, serve them all."""
    sock = bind_socket(args.host, args.port)
    try:
        from kvroom.server.lifecycle import serve
        from kvroom.server.multi.app import create_multi_app

        models = open_models(args)
        app = create_multi_app(models, admin_key=args.admin_key, **_http_options(args))
        host, port = sock.getsockname()[:2]
        for name, slot in models.slots.items():
            _say(f"model {name}: {slot.entry.artifact}, {slot.stats().num_total_blocks} blocks")
        _say(f"memory budget {models.budget.describe()}")
        names = ", ".join(models.slots)
        _say(f"serving {names} on {_url(host, port)} (OpenAI API under /v1)")
        serve(app, sock, access_log=args.access_log, shutdown_timeout_s=args.shutdown_timeout)
    finally:
        sock.close()
    _say("server stopped")
    return 0


def _http_options(args: argparse.Namespace) -> dict[str, Any]:
    """``create_app``'s API key and body cap from the flags (and ``$KVROOM_API_KEY``)."""
    import os

    from kvroom.server.auth import API_KEY_ENV

    options: dict[str, Any] = {"api_key": args.api_key or os.environ.get(API_KEY_ENV) or None}
    if args.max_request_bytes is not None:
        if args.max_request_bytes <= 0:
            raise ConfigError(f"--max-request-bytes: must be > 0, got {args.max_request_bytes}")
        options["max_request_bytes"] = args.max_request_bytes
    return options


def cmd_serve_vllm(args: argparse.Namespace) -> int:
    """``--engine vllm``: the same start-up plan, persisted on request, served by vLLM."""
    launch = launch_for(args)
    if args.persist:
        _say(persist(args.artifact, launch.plan.num_blocks))
    return serve_with_vllm(args, launch)


def persist(path: str, num_blocks: int) -> str:
    """Write ``num_blocks`` into the artifact (atomic ``set``); returns a note for the KV line."""
    from kvroom.artifact.resize import get_kvcache_num_blocks, set_kvcache_num_blocks

    if get_kvcache_num_blocks(path) == num_blocks:
        return f"artifact already records {num_blocks} blocks"
    set_kvcache_num_blocks(path, num_blocks)
    return f"persisted {num_blocks} blocks to the artifact"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 when ``host`` has a colon); uvicorn listens.

    Raises:
        ConfigError: the port is out of range, or the address cannot be bound.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port: must be in [0, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"--host/--port: cannot listen on {host}:{port} ({exc.strerror or exc}); "
            "pick another --port (0 = any free one) or stop what holds it"
        ) from exc
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _say(line: str) -> None:
    sys.stdout.write(f"kvroom serve: {line}\n")
    sys.stdout.flush()
