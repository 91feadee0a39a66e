"""Scoring for ``facts_gen.yaml``: the reply's first word, and the answer anywhere in it."""

from __future__ import annotations

import re

WORD = re.compile(r"[A-Za-z0-9]+")


def process_results(doc: dict, results: list[str]) -> dict[str, int]:
    """``exact_match``: the reply's first word is the answer; ``contains``: the answer appears
    in the reply as a whole word (both ignore case and punctuation)."""
    answer = doc["choices"][doc["answer"]].lower()
    words = [w.lower() for w in WORD.findall(results[0])]
    wanted = [w.lower() for w in WORD.findall(answer)]
    first = words[: len(wanted)] == wanted
    inside = any(words[i : i + len(wanted)] == wanted for i in range(len(words)))
    return {"exact_match": int(first), "contains": int(inside)}
