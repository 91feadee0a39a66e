"""Cost of structured outputs: a batch of chat requests all JSON-constrained vs unconstrained.

python benchmarks/structured.py artifacts/smollm2-135m [--num-requests 32 --new-tokens 64]

Both runs are greedy over the same prompts in one process (unconstrained first, then again
after the constrained run, to bracket drift). The constrained run's schema keeps the model
writing (an array of strings) and the unconstrained run ignores EOS, so both runs are
mostly decode steps of the full batch; tok/s counts the tokens each run really generated.
The mask figures are ``StructuredOutputs``' own counters: time filling bitmasks (on the
worker thread) and the part of it the forward pass did not hide (``apply`` waiting).
"""

from __future__ import annotations

import argparse
import time

from kvroom import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "tags"],
}


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results), seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(args.artifact)
    prompts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe item {i} as JSON with a title and tags."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(args.num_requests)
    ]
    free = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(temperature=0, max_tokens=args.new_tokens, structured_outputs=so)
    run(llm, prompts[:2], constrained)  # warm-up: tokenizer info, compile, matcher paths
    structured = llm.runtime.runner.structured
    assert structured is not None
    structured.fill_seconds = structured.wait_seconds = 0.0
    rows = [("unconstrained", *run(llm, prompts, free))]
    rows.append(("json-constrained", *run(llm, prompts, constrained)))
    rows.append(("unconstrained (again)", *run(llm, prompts, free)))
    print(f"workload: {args.num_requests} chat requests x up to {args.new_tokens} tokens, greedy")
    print(f"{'run':24} {'tokens':>7} {'seconds':>8} {'tok/s':>7}")
    for name, tokens, seconds in rows:
        print(f"{name:24} {tokens:7d} {seconds:8.2f} {tokens / seconds:7.1f}")
    free_rate = (rows[0][1] / rows[0][2] + rows[2][1] / rows[2][2]) / 2
    ratio = (rows[1][1] / rows[1][2]) / free_rate
    print(f"constrained / unconstrained tok/s: {ratio:.3f}")
    print(
        f"mask fill {structured.fill_seconds * 1e3:.1f} ms in total, of which "
        f"{structured.wait_seconds * 1e3:.1f} ms not hidden by the forward "
        f"({structured.wait_seconds / rows[1][2] * 100:.2f}% of the run)"
    )


if __name__ == "__main__":
    main()
