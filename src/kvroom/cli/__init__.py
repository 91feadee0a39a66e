"""``kvroom`` command line: user errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys

from kvroom.errors import KvroomError

UPSTREAM_SPELLINGS = {"--get-kvcache-num-blocks": "get", "--set-kvcache-num-blocks": "set"}


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (and exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def normalize_argv(argv: list[str]) -> list[str]:
    """Accept the upstream spellings: ``--get-kvcache-num-blocks OUT`` and
    ``--set-kvcache-num-blocks N OUT`` (note: N before OUT)."""
    if argv and argv[0] in UPSTREAM_SPELLINGS:
        command = UPSTREAM_SPELLINGS[argv[0]]
        rest = argv[1:]
        if command == "set" and len(rest) >= 2 and not _is_flag(rest[0]):
            rest = [rest[1], rest[0], *rest[2:]]
        return [command, *rest]
    return argv


def _is_flag(arg: str) -> bool:
    """``--device-memory`` or ``-h`` is a flag; ``-3`` is a (bad) block count, not a flag."""
    return arg.startswith("-") and not arg[1:].isdigit()


def main(argv: list[str] | None = None) -> int:
    from kvroom.cli.commands import build_parser

    args = build_parser(OneLineParser).parse_args(
        normalize_argv(list(sys.argv[1:] if argv is None else argv))
    )
    logging.basicConfig(level=logging.INFO, format="kvroom: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KvroomError as exc:
        message = " ".join(str(exc).split())
        sys.stderr.write(f"kvroom: error: {message}\n")
        return 2
    except KeyboardInterrupt:
        return 130
