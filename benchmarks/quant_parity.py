"""The default model with its GGUF weights as shipped against the same model dequantized to fp32.

Three comparisons, on two artifacts of the same GGUF (``kvroom compile smollm2-135m`` and
``kvroom compile smollm2-135m --dequantize``):

* greedy tokens of 8 chat prompts x 32 new tokens (identical or not, per prompt);
* logits at each of those 32 positions, teacher-forced on the fp32 tokens: max abs difference;
* perplexity of a local text (default ``docs/ARCHITECTURE.md``, its first ``--ppl-tokens``
  tokens) from prompt logprobs: the relative difference.

    python benchmarks/quant_parity.py --workdir /path/to/workdir \
        --json benchmarks/results-quant-parity.json

Missing artifacts are compiled into ``--workdir`` without the profiling pass (their weights are
what the comparison needs).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvroom import LLM, SamplingParams
from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Name a famous painting by Vermeer and describe it briefly.",
]
NEW_TOKENS = 32
COMPILE = {"max_seq_len": 2048, "batch_size": 8, "kvcache_num_blocks": 1024}


def artifact(workdir: Path, name: str, quantization: str | None) -> Path:
    from kvroom.compile import compile as kvroom_compile

    out = workdir / name
    if not (out / "kvroom_config.json").is_file():
        kvroom_compile(
            "smollm2-135m", out, {**COMPILE, "quantization": quantization}, profile=False
        )
    return out


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    return [list(r.token_ids) for r in results]


def teacher_forced_logits(llm: LLM, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` predicting each of ``tokens`` after ``prompt``."""
    runner = llm.runtime.runner
    block = llm.runtime.info.config.kvcache_block_size
    seq = prompt + tokens
    table = tuple(range(-(-len(seq) // block)))
    rows, done = [], 0
    for end in range(len(prompt), len(seq)):
        chunk = ScheduledSeq(
            seq_id=10_000,
            token_ids=tuple(seq[done:end]),
            start_pos=done,
            block_table=table,
            sliding_slot=0,
            needs_sample=True,
            sampling=SamplingParams(temperature=0.0),
        )
        rows.append(runner.compute_logits(SchedulerOutput((chunk,)))[1][0])
        done = end
    return torch.stack(rows)


def perplexity(llm: LLM, ids: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    result = llm.generate([ids], params)[0]
    logprobs = [d[t].logprob for d, t in zip(result.prompt_logprobs[1:], ids[1:], strict=True)]
    return math.exp(-sum(logprobs) / len(logprobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument(
        "--text", type=Path, default=Path(__file__).parents[1] / "docs/ARCHITECTURE.md"
    )
    parser.add_argument("--ppl-tokens", type=int, default=2040)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llms = {
        "gguf": LLM(str(artifact(args.workdir, "gguf", None))),
        "fp32": LLM(str(artifact(args.workdir, "fp32", "none"))),
    }
    tokens = {name: greedy(llm) for name, llm in llms.items()}
    same = [a == b for a, b in zip(tokens["gguf"], tokens["fp32"], strict=True)]
    max_diff = 0.0
    for prompt, generated in zip(PROMPTS, tokens["fp32"], strict=True):
        ids = llms["fp32"].apply_chat_template([{"role": "user", "content": prompt}])
        a, b = (teacher_forced_logits(llm, ids, generated) for llm in llms.values())
        max_diff = max(max_diff, float((a - b).abs().max()))
    text_ids = llms["fp32"].tokenizer.encode(args.text.read_text())[: args.ppl_tokens]
    ppl = {name: perplexity(llm, text_ids) for name, llm in llms.items()}
    result = {
        "prompts": len(PROMPTS),
        "new_tokens": NEW_TOKENS,
        "identical_greedy": sum(same),
        "max_abs_logit_diff": max_diff,
        "perplexity_text": str(args.text.name),
        "perplexity_tokens": len(text_ids),
        "perplexity": ppl,
        "perplexity_rel_diff": abs(ppl["gguf"] - ppl["fp32"]) / ppl["fp32"],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
