"""The grammar engine: ``StructuredOutputsParams`` -> a compiled grammar, cached per engine.

Why xgrammar. It is the grammar backend vLLM and SGLang use by default, maintained by the MLC
team, and it has what a batched engine needs: one ``TokenizerInfo`` per tokenizer, a
thread-safe ``GrammarCompiler`` with a compile cache, matchers that fill a 32-tokens-per-int
bitmask in C++ (``BatchGrammarMatcher`` fills many at once, off the GIL), a CPU
``apply_token_bitmask_inplace`` kernel, and rollback. Its wheel installs on CPU with the torch
kvroom pins (it requires ``torch>=1.10``; pip keeps 2.13.0). llguidance (Microsoft, Rust)
masks fast too but is vLLM's second backend and brings its own grammar dialect (Lark);
outlines-core compiles regexes to DFAs up front, slow for large JSON schemas and without
recursion. The GBNF-style EBNF that vLLM's ``grammar`` field takes is xgrammar's syntax.

The xgrammar objects are built on first use (building ``TokenizerInfo`` reads the whole
vocabulary), so an engine that never sees a constraint pays nothing.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvroom.engine.params.structured import StructuredOutputError, StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept (LRU, per engine), on top of xgrammar's own cache."""
_XGR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarCompiler:
    """Compiles constraints for one tokenizer and one logits width; thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """
        Args:
            tokenizer: the HF tokenizer of the model.
            vocab_size: width of the model's logits; it may exceed the tokenizer's vocabulary
                (padded embeddings), and ids past the tokenizer's are never allowed.
            stop_token_ids: the ids that end a sequence (EOS); the grammar allows them once
                the output is complete.
        """
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(set(stop_token_ids))
        self._cache: OrderedDict[tuple[str, ...], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._compiler: Any = None

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``params`` (cached by ``params.key``).

        Raises:
            StructuredOutputError: the schema, regex or grammar does not compile; the message
                names the field and xgrammar's reason.
        """
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(params)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._xgr_compiler()
        kind = params.kind
        try:
            if kind == "json" or kind == "json_object":
                schema = params.json if kind == "json" else {"type": "object"}
                return compiler.compile_json_schema(
                    json.dumps(schema),
                    any_whitespace=not params.disable_any_whitespace,
                    strict_mode=params.strict,
                )
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice or ()))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise StructuredOutputError(
                f"structured_outputs.{kind}: the {_noun(kind)} does not compile: {_reason(exc)}"
            ) from exc

    def _xgr_compiler(self) -> Any:
        """xgrammar's compiler over this tokenizer, built once (the first call pays)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    copy.deepcopy(self._tokenizer),  # never shared with another thread's
                    vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF whose root is exactly one of ``choices`` (vLLM's ``choice_as_grammar``)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    lines = [_XGR_LOCATION.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line)


def _noun(kind: str) -> str:
    return {"json": "JSON schema", "regex": "regular expression"}.get(kind, kind)
