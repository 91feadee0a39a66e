"""``kvroom resize URL [N|auto]``: show or change a running server's KV pool (admin API).

The key comes from ``--admin-key`` or ``KVROOM_ADMIN_KEY``; the server's answer is printed as
one line (``--json``: the whole state); a multi-model server's answer is one line per model,
and ``--model NAME`` (``--pin``) resizes one of its pools. A refusal (policy, reserve, key) is
the server's message on stderr and exit code 2, like every kvroom user error.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

from kvroom.errors import KvroomError


class AdminRequestError(KvroomError, RuntimeError):
    """The server refused or could not be reached."""


def add_resize_command(sub: Any) -> None:
    p = sub.add_parser("resize", help="show or resize a running server's KV pool (N or auto)")
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("num_blocks", nargs="?", default=None, help="new size, or 'auto'; omit to show")
    p.add_argument("--persist", action="store_true", help="also write it into the artifact")
    p.add_argument("--admin-key", default=None, help="the server's --admin-key ($KVROOM_ADMIN_KEY)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait (default 120)")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p.add_argument("--model", default=None, help="several models served: the pool to resize")
    p.add_argument(
        "--pin", action="store_true", help="with --model: the arbiter leaves the pool at N"
    )
    p.set_defaults(func=cmd_resize)


def cmd_resize(args: argparse.Namespace) -> int:
    body = None
    if args.num_blocks is not None:
        value: int | str = args.num_blocks
        if value != "auto":
            if not value.lstrip("-").isdigit():
                raise AdminRequestError(f"num_blocks: must be an integer or 'auto', got {value!r}")
            value = int(value)
        body = {"num_blocks": value, "persist": args.persist}
        if args.model is not None:
            body = {"model": args.model, "num_blocks": value, "pin": args.pin}
    key = args.admin_key or os.environ.get("KVROOM_ADMIN_KEY")
    state = admin_request(args.url, body, key=key, timeout=args.timeout)
    print(json.dumps(state, indent=2) if args.json else describe(state))
    return 0


def admin_request(
    url: str, body: dict[str, Any] | None, *, key: str | None, timeout: float
) -> dict[str, Any]:
    """``GET`` (body None) or ``POST`` ``URL/kv_cache``; the decoded JSON answer.

    Raises:
        AdminRequestError: an HTTP error (with the server's message) or no connection.
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url.rstrip('/')}/kv_cache", data=data)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AdminRequestError(f"{url}: HTTP {exc.code}: {_message(exc.read())}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AdminRequestError(f"{url}: cannot reach the server ({reason})") from None


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:200]


def describe(state: dict[str, Any]) -> str:
    """One line: what the resize did (if one was made), then the pool now; a multi-model
    server: the budget, then a line per model."""
    if "models" in state:
        return _describe_models(state)
    mib = state["bytes"] / 2**20
    now = (
        f"{state['num_blocks']} blocks x {state['block_size']} tokens = {state['num_tokens']} "
        f"tokens ({mib:.1f} MiB), {state['num_used_blocks']} used, range "
        f"{state['min_num_blocks']}..{state['max_num_blocks']}, {state['num_resizes']} resizes"
    )
    done = state.get("resize")
    if done is None:
        return f"KV cache: {now}"
    return (
        f"KV cache resized {done['from_blocks']} -> {done['to_blocks']} blocks in "
        f"{done['seconds'] * 1e3:.1f} ms ({done['num_moved_blocks']} blocks moved, "
        f"{done['num_preempted']} sequences preempted); now {now}"
    )


def _describe_models(state: dict[str, Any]) -> str:
    lines = [
        f"memory budget {state['memory_budget_bytes'] / 2**20:.1f} MiB "
        f"({state['memory_budget_source']}), pools may hold "
        f"{state['kv_pool_budget_bytes'] / 2**20:.1f} MiB"
    ]
    for name, pool in state["models"].items():
        if not pool["loaded"]:
            lines.append(f"{name}: evicted (loaded {pool['num_loads']} times)")
            continue
        pin = ", pinned" if pool["pinned"] else ""
        lines.append(f"{name}: {describe({k: v for k, v in pool.items() if k != 'models'})}{pin}")
    done = state.get("resize")
    if done is not None:
        lines.insert(0, f"resized {done['from_blocks']} -> {done['to_blocks']} blocks")
    return "\n".join(lines)
