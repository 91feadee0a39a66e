"""Sub-commands that run an artifact: ``run`` (and the server and benchmark commands)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvroom.cli.options import add_prefix_caching_flag, add_startup_flags, startup_overrides
from kvroom.cli.serve_command import add_serve_command
from kvroom.cli.vllm_command import add_vllm_args_command


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="most tokens to generate (default: what max_seq_len leaves after the prompt)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help=">= 0; 0 = greedy (default 0)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the most likely tokens whose probabilities add up to P, 0 < P <= 1 "
        "(default 1: all)",
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample from the K most likely tokens (default 0: all)"
    )
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-text token"
    )


SAMPLING_FLAGS = {
    "max_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
    "stop": "--stop",
}
"""``SamplingParams`` field -> the ``kvroom run`` flag that sets it (errors name the flag)."""


def add_runtime_commands(sub: Any) -> None:
    p = sub.add_parser("run", help="generate text from an artifact, streamed to stdout")
    p.add_argument("artifact")
    p.add_argument("--prompt", required=True)
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image for a model that takes images (repeatable); the prompt gets the "
        "model's placeholder before the text unless it already holds one per image",
    )
    add_sampling_flags(p)
    add_startup_flags(p)
    add_prefix_caching_flag(p)
    p.set_defaults(func=cmd_run)
    add_serve_command(sub)
    add_vllm_args_command(sub)

    p = sub.add_parser("bench", help="throughput against HF transformers on the same artifact")
    p.add_argument("artifact")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--single-stream-tokens", type=int, default=64)
    p.add_argument("--peers", default="hf-padded,hf-batch", help="comma list; '' for none")
    p.add_argument("--no-load-test", action="store_true", help="skip load-to-first-token")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.set_defaults(func=cmd_bench)


def sampling_params(args: argparse.Namespace) -> Any:
    """The flags' ``SamplingParams`` (``max_tokens`` 1 stands in until the prompt is known
    when ``--max-new-tokens`` is not given).

    Raises:
        ConfigError: a flag's value is out of range; the message names the flag.
    """
    from kvroom.engine.params.sampling import SamplingParams
    from kvroom.errors import ConfigError

    try:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=1 if args.max_new_tokens is None else args.max_new_tokens,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
    except ConfigError as exc:
        raise ConfigError(_with_flag_name(str(exc))) from None


def _with_flag_name(message: str) -> str:
    """``SamplingParams.top_p: must be ...`` -> ``--top-p: must be ...``."""
    field, sep, rest = message.removeprefix("SamplingParams.").partition(":")
    return f"{SAMPLING_FLAGS[field]}{sep}{rest}" if sep and field in SAMPLING_FLAGS else message


def cmd_run(args: argparse.Namespace) -> int:
    from kvroom.llm import LLM

    params = sampling_params(args)
    llm = LLM(args.artifact, **startup_overrides(args))
    use_chat = not args.no_chat_template and getattr(llm.tokenizer, "chat_template", None)
    text = _with_placeholders(llm, args.prompt, len(args.image)) if args.image else args.prompt
    prompt: Any = text
    if use_chat:
        prompt = llm.apply_chat_template([{"role": "user", "content": text}])
    if args.image:
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        prompt = {key: prompt, "multi_modal_data": {"image": list(args.image)}}
    printed = 0
    for out in llm.stream(prompt, params, fill_context=args.max_new_tokens is None):
        text = out.text or ""
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
    sys.stdout.write("\n")
    return 0


def _with_placeholders(llm: Any, text: str, num_images: int) -> str:
    """``text`` with the model's image placeholder once per image in front, unless the text
    already holds them (vLLM's chat API also puts images before the text).

    Raises:
        ConfigError: the model takes no images.
    """
    from kvroom.errors import ConfigError

    placeholder = getattr(llm.runtime.runner.model, "image_placeholder", None)
    if placeholder is None:
        raise ConfigError(f"--image: {llm.runtime.spec.architecture} does not take images")
    if text.count(placeholder) == num_images:
        return text
    return placeholder * num_images + text


def cmd_bench(args: argparse.Namespace) -> int:
    from kvroom.bench import dump, print_report, run_bench

    results = run_bench(
        args.artifact,
        num_requests=args.num_requests,
        new_tokens=args.new_tokens,
        single_stream_tokens=args.single_stream_tokens,
        peers=tuple(p for p in args.peers.split(",") if p),
        load_test=not args.no_load_test,
    )
    print_report(results)
    if args.json:
        dump(results, args.json)
    return 0
