"""CLI flags generated from ``DecoderOnlyConfig`` fields (kebab-case), help from their docstrings,
so the flags and the config cannot drift apart."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from typing import Any

from kvroom.config import DecoderOnlyConfig

INT_FIELDS = {
    "max_seq_len",
    "batch_size",
    "kvcache_block_size",
    "max_num_batched_tokens",
    "tensor_parallel_size",
    "kvcache_num_blocks",
}
FLOAT_FIELDS = {"kvcache_memory_fraction"}
RUNTIME_FIELDS = (
    "kvcache_num_blocks",
    "device_memory",
    "kvcache_reserve_memory",
    "kvcache_memory_fraction",
)
"""Fields that ``run``/``serve`` may override at start-up without rebuilding."""


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal right after each field) of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        is_field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if is_field and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def add_config_flags(
    parser: argparse.ArgumentParser,
    only: tuple[str, ...] | None = None,
    types: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
) -> None:
    """One flag per saveable config field (or only those named); default None = config default.

    ``types`` overrides a field's parser (``run`` takes ``--kvcache-num-blocks N|auto``),
    ``helps`` its help (where the flag means more than the field)."""
    docs = field_docs(DecoderOnlyConfig)
    excluded = DecoderOnlyConfig.non_save_attributes()
    for f in dataclasses.fields(DecoderOnlyConfig):
        if f.name in excluded or (only is not None and f.name not in only):
            continue
        kind = _int if f.name in INT_FIELDS else _float if f.name in FLOAT_FIELDS else str
        kind = (types or {}).get(f.name, kind)
        default = "" if f.default is None else f" (default: {f.default})"
        text = (helps or {}).get(f.name) or docs.get(f.name, "") + default
        parser.add_argument(flag(f.name), dest=f.name, type=kind, default=None, help=text)


def add_dequantize_flag(parser: argparse.ArgumentParser) -> None:
    """``--dequantize``: ``--quantization none`` (a GGUF's blocks expanded to ``--dtype``)."""
    parser.add_argument(
        "--dequantize",
        dest="quantization",
        action="store_const",
        const="none",
        help="expand a GGUF's quantized blocks to --dtype (same as --quantization none)",
    )


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields given on the command line."""
    names = {f.name for f in dataclasses.fields(DecoderOnlyConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def add_startup_flags(parser: argparse.ArgumentParser, *, elastic: bool = False) -> None:
    """The start-up override: resize the pool for this start without touching the artifact
    (``elastic``: ``serve``'s pool that follows the memory is offered too)."""
    follow = ", or elastic = follow the memory while serving" if elastic else ""
    blocks = (
        "KV blocks for this start (the artifact is not changed): N, or auto = re-estimate for "
        f"this machine's memory{follow} (default: the artifact's)"
    )
    add_config_flags(
        parser,
        only=RUNTIME_FIELDS,
        types={"kvcache_num_blocks": str},
        helps={"kvcache_num_blocks": blocks},
    )
    parser.add_argument("--device", default=None, help="run on this device instead (cpu, cuda)")


def add_prefix_caching_flag(parser: argparse.ArgumentParser) -> None:
    """``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` (vLLM's spelling)."""
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV of full blocks earlier prompts computed (system prompts, multi-turn "
        "chat); default on, always off for models with sliding-window layers",
    )


def startup_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments the start-up flags ask for."""
    overrides = config_overrides(args)
    if getattr(args, "device", None):
        overrides["device"] = args.device
    if getattr(args, "enable_prefix_caching", None) is not None:
        overrides["enable_prefix_caching"] = args.enable_prefix_caching
    return overrides


def add_tool_call_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling flags for ``serve``."""
    from kvroom.server.openai.tool_calls import TOOL_CALL_PARSERS

    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs '
        "--tool-call-parser",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=None,
        help="how the model writes tool calls: hermes = <tool_call>{json}</tool_call> "
        "(Hermes, Qwen2.5, SmolLM-style templates)",
    )


def tool_options(args: argparse.Namespace) -> Any:
    """``create_app``'s ``ToolOptions`` from the flags (``ConfigError`` if inconsistent)."""
    from kvroom.server.openai.tools import ToolOptions

    return ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser)
