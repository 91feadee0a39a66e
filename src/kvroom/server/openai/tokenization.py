"""Tokenizing off the event loop: a small thread pool, one tokenizer copy per worker thread.

Tokenizing a long text holds the calling thread for a while (a 10 MB prompt: seconds), so on
the event loop it would stall every other request, ``/health`` included. vLLM's server runs
its tokenizer in a worker pool for the same reason. A fast tokenizer is not safe to use from
two threads at once, so each worker thread deep-copies its own when the pool starts; the event
loop keeps one copy for the cheap single-token decodes of logprobs (cached).

Before tokenizing, a text that cannot fit is refused outright: no token covers more than
``max_token_chars`` characters, so a text longer than ``max_seq_len * max_token_chars``
characters has more than ``max_seq_len`` tokens whatever the tokenizer makes of it.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

DEFAULT_NUM_WORKERS = 2


class TokenizerPool:
    """Async encode / chat template / decode over per-thread copies of one tokenizer."""

    def __init__(self, tokenizer: Any, num_workers: int = DEFAULT_NUM_WORKERS) -> None:
        self._template = copy.deepcopy(tokenizer)
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="kvroom-tokenizer")
        self._start_workers(num_workers)
        self.loop_tokenizer = copy.deepcopy(tokenizer)
        """The event loop's own copy: chat-template checks and single-token decodes."""
        self.max_token_chars = _max_token_chars(tokenizer)
        """Upper bound on the characters one token stands for."""

    def _start_workers(self, num_workers: int) -> None:
        """Start every worker with its tokenizer copy now: the server's memory is then all
        there when it starts listening (and counted by the plan's profile), not later."""
        everyone = threading.Barrier(num_workers)

        def start() -> None:
            self._worker_tokenizer()
            everyone.wait()  # holds each thread until all have started

        for done in [self._executor.submit(start) for _ in range(num_workers)]:
            done.result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def cannot_fit(self, text: str, max_len: int) -> bool:
        """True when ``text`` has more than ``max_len`` tokens for certain (no tokenizing)."""
        return len(text) > max_len * self.max_token_chars

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = await self._run(_encode, text, add_special_tokens)
        return list(ids)

    async def chat_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat template's token ids (``tools`` passed to it, as vLLM does)."""
        return list(await self._run(_chat_ids, messages, add_generation_prompt, tools))

    async def decode(self, ids: Sequence[int]) -> str:
        return await self._run(_decode, list(ids))

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one pool per server, lives as long)
    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (logprobs' ``token``), on the event loop."""
        return self.loop_tokenizer.decode([token_id])

    async def _run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn, args)

    def _call(self, fn: Any, args: tuple[Any, ...]) -> Any:
        return fn(self._worker_tokenizer(), *args)

    def _worker_tokenizer(self) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self._template)
        return tokenizer


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def _chat_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
) -> list[int]:
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def _max_token_chars(tokenizer: Any) -> int:
    """Longest vocabulary entry, in characters of its stored form.

    Byte-level BPE stores one character per byte, SentencePiece one per character, so the
    stored form is never shorter than the text the token decodes to.
    """
    vocab = tokenizer.get_vocab()
    return max((len(piece) for piece in vocab), default=1) or 1
