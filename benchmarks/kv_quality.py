"""Quality of the KV dtypes on the default model: perplexity and greedy agreement.

One fp32-weight artifact of ``smollm2-135m`` per KV format (``--dequantize``, so only the KV
differs): float32, bfloat16, fp8 (e4m3), int8 and int4, the two integer ones with and without
the Hadamard rotation. For each:

* perplexity of a local held-out text (the project's own docs, written after the model was
  trained), ``--windows`` windows of ``--window`` tokens, each attended from its start;
* greedy agreement with float32 KV over 32 chat prompts x 64 new tokens: prompts whose tokens
  are identical, and the mean share of tokens before the first difference;
* accuracy on the project's 40-question multiple-choice task (``lm_eval/facts_mc.jsonl``),
  scored as lm-eval scores it (``acc``: the choice of the largest log-likelihood after the
  question; ``acc_norm``: per character), from the engine's prompt log-probabilities.

    python benchmarks/kv_quality.py --workdir /path/to/workdir --json results-kv-quality.json

Missing artifacts are compiled into ``--workdir`` without the profiling pass (a few minutes in
all); every one is started with the same pool (``--blocks``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path

from kvroom import LLM, SamplingParams

VARIANTS = {  # name -> (kv_dtype, kv_rotation)
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "fp8": ("float8_e4m3fn", "none"),
    "int8": ("int8", "hadamard"),
    "int8-norot": ("int8", "none"),
    "int4": ("int4", "hadamard"),
    "int4-norot": ("int4", "none"),
}
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Name a famous painting by Vermeer and describe it briefly.",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "List four primary colors used in printing.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a small bakery.",
    "What is the difference between weather and climate?",
    "Write a short thank-you note to a teacher.",
    "Explain recursion to a ten-year-old.",
    "What are the main ingredients of pancakes?",
    "Describe a sunset over the mountains.",
    "Why do cats purr?",
    "Give an example of a prime number greater than 50.",
    "What is photosynthesis?",
    "Write two lines of a poem about autumn leaves.",
    "How many continents are there, and which is the largest?",
    "What does a compiler do?",
    "Recommend a book for someone who likes mysteries.",
    "Explain what inflation means in economics.",
    "How do I make a cup of green tea?",
    "What is the boiling point of water at sea level?",
    "Describe the water cycle in three steps.",
    "Write a tweet announcing a new coffee shop.",
    "What is the Pythagorean theorem?",
]
NEW_TOKENS = 64


def artifact(workdir: Path, name: str) -> Path:
    from kvroom.compile import compile as kvroom_compile

    out = workdir / name
    if not (out / "kvroom_config.json").is_file():
        kv_dtype, rotation = VARIANTS[name]
        cfg = {"max_seq_len": 2048, "batch_size": 32, "kvcache_num_blocks": 2100}
        cfg |= {"quantization": "none", "kv_dtype": kv_dtype, "kv_rotation": rotation}
        kvroom_compile("smollm2-135m", out, cfg, profile=False)
    return out


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    """exp(mean NLL) over every predicted token of every window (each from its own start)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    nll, count = 0.0, 0
    for ids, result in zip(windows, llm.generate(windows, params), strict=True):
        pairs = zip(result.prompt_logprobs[1:], ids[1:], strict=True)
        nll -= sum(d[t].logprob for d, t in pairs)
        count += len(ids) - 1
    return math.exp(nll / count)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    return [list(r.token_ids) for r in results]


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> dict[str, float]:
    """Identical prompts, and the mean share of tokens before the first difference."""
    prefix = []
    for a, b in zip(tokens, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        prefix.append(n / len(b))
    same = sum(a == b for a, b in zip(tokens, ref, strict=True))
    return {"identical": same, "prefix_share": sum(prefix) / len(prefix)}


def multiple_choice(llm: LLM, path: Path) -> dict[str, float]:
    """acc and acc_norm over the task's questions (``" " + choice`` after the question)."""
    docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts, spans = [], []
    for doc in docs:
        context = llm.tokenizer.encode(doc["question"])
        for choice in doc["choices"]:
            ids = llm.tokenizer.encode(doc["question"] + " " + choice)
            prompts.append(ids)
            spans.append(len(context))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    scores = []
    for ids, start, result in zip(prompts, spans, llm.generate(prompts, params), strict=True):
        pairs = zip(result.prompt_logprobs[start:], ids[start:], strict=True)
        scores.append(sum(d[t].logprob for d, t in pairs))
    acc = norm = 0
    for doc in docs:
        n = len(doc["choices"])
        own, scores = scores[:n], scores[n:]
        lengths = [len(c) for c in doc["choices"]]  # lm-eval: the choice alone
        acc += max(range(n), key=lambda i: own[i]) == doc["answer"]
        norm += max(range(n), key=lambda i: own[i] / lengths[i]) == doc["answer"]
    return {"mc_acc": acc / len(docs), "mc_acc_norm": norm / len(docs)}


def text_windows(llm: LLM, text: str, window: int, count: int) -> list[list[int]]:
    ids = llm.tokenizer.encode(text)
    if len(ids) < window * count:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {count} x {window}")
    return [ids[i * window : (i + 1) * window] for i in range(count)]


def measure(llm: LLM, args: argparse.Namespace, text: str, ref: list[list[int]] | None) -> dict:
    """The measures asked for, of one variant; greedy tokens kept under ``tokens``."""
    row: dict = {}
    if "ppl" in args.measures:
        row["perplexity"] = perplexity(llm, text_windows(llm, text, args.window, args.windows))
    if "greedy" in args.measures:
        tokens = greedy(llm)
        row |= agreement(tokens, tokens if ref is None else ref) | {"tokens": tokens}
    if "mc" in args.measures:
        row |= multiple_choice(llm, Path(__file__).parent / "lm_eval" / "facts_mc.jsonl")
    return row


def workdir_and_text_parser(description: str) -> argparse.ArgumentParser:
    """``--workdir`` (the artifacts) and ``--text`` (the perplexity text), which the KV
    quality scripts share."""
    root = Path(__file__).parents[1]
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument(
        "--text", type=Path, nargs="+", default=[root / "docs/ARCHITECTURE.md", root / "README.md"]
    )
    return parser


def main() -> None:
    parser = workdir_and_text_parser(__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=512, help="pool blocks at start-up")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--measures", nargs="+", default=["ppl", "greedy", "mc"], choices=["ppl", "greedy", "mc"]
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    text = "\n\n".join(p.read_text() for p in args.text)  # read once: every variant the same
    rows: dict[str, dict[str, float]] = {}
    ref: list[list[int]] | None = None
    for name in args.variants:
        llm = LLM(str(artifact(args.workdir, name)), kvcache_num_blocks=args.blocks)
        rows[name] = measure(llm, args, text, ref)
        ref = ref if ref is not None or "tokens" not in rows[name] else rows[name]["tokens"]
        print(name, json.dumps({k: v for k, v in rows[name].items() if k != "tokens"}), flush=True)
        del llm
        gc.collect()
    base = rows.get("bfloat16")
    for row in rows.values():
        row.pop("tokens", None)
        if base is not None and "perplexity" in row:
            row["ppl_vs_bf16"] = row["perplexity"] / base["perplexity"] - 1
    result = {
        "reference": args.variants[0],
        "text": [p.name for p in args.text],
        "tokens": args.window * args.windows,
        "window": args.window,
        "prompts": len(PROMPTS),
        "new_tokens": NEW_TOKENS,
        "variants": rows,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
