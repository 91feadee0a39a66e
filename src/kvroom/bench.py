"""``kvroom bench``: kvroom against Hugging Face transformers on the same artifact, one process.

Workload: ``num_requests`` short chat prompts, ``new_tokens`` greedy tokens each, EOS ignored.
Peers: HF ``generate_batch`` (continuous batching) and HF ``generate`` of all prompts at once
(left-padded). Also single-stream decode (one request) and, in fresh processes, load to first
token. Every figure is tokens/s or seconds; ratios are kvroom / peer.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM

TOPICS = (
    "the ocean",
    "volcanoes",
    "honey bees",
    "the moon",
    "jazz",
    "bread",
    "glaciers",
    "chess",
    "owls",
    "copper",
    "rainbows",
    "tea",
)


@dataclass(frozen=True)
class Measurement:
    name: str
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` distinct short chat prompts, tokenized with the artifact's chat template."""
    prompts = []
    for i in range(n):
        text = f"Tell me fact number {i + 1} about {TOPICS[i % len(TOPICS)]}."
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        prompts.append(list(ids))
    return prompts


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - start


def bench_kvroom(
    llm: LLM, prompts: list[list[int]], new_tokens: int
) -> tuple[int, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    results = llm.generate(prompts, params)
    return sum(len(r.token_ids) for r in results), [list(r.token_ids) for r in results]


def bench_hf_padded(
    model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int
) -> tuple[int, list[list[int]]]:
    import torch

    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    new = out[:, width:]
    return int(new.numel()), new.tolist()


def bench_hf_batch(model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=tokenizer.pad_token_id,
    )
    outputs = model.generate_batch(prompts, generation_config=config)
    return sum(len(o.generated_tokens) for o in outputs.values())


_SINCE_START = """
import time, psutil
print("FIRST_TOKEN_S", time.time() - psutil.Process().create_time())
"""
"""Seconds from the process's creation (interpreter start included) to its first token; what
the process does after (tearing down a multi-GiB pool, say) is not load time."""
LOAD_KVROOM = (
    """
import sys, time
from kvroom.llm import LLM
from kvroom.engine.params.sampling import SamplingParams
llm = LLM(sys.argv[1], kvcache_num_blocks=sys.argv[2])
llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=1))
"""
    + _SINCE_START
)
LOAD_HF = (
    """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvroom.artifact.layout import hf_load_kwargs
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], **hf_load_kwargs(sys.argv[1]))
model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=1, do_sample=False)
"""
    + _SINCE_START
)


def load_to_first_token(
    runs: dict[str, tuple[str, list[str]]], repeats: int = 3
) -> dict[str, float]:
    """Per name, the median seconds from a fresh interpreter's start to the first token of
    ``script args``; the names take turns, so a busy spell hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (script, args) in runs.items():
            cmd = [sys.executable, "-c", script, *args]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            line = next(ln for ln in out.splitlines() if ln.startswith("FIRST_TOKEN_S "))
            times[name].append(float(line.split()[1]))
    return {name: statistics.median(t) for name, t in times.items()}


def run_bench(
    artifact: str | Path,
    *,
    num_requests: int = 32,
    new_tokens: int = 64,
    single_stream_tokens: int = 64,
    peers: tuple[str, ...] = ("hf-padded", "hf-batch"),
    load_test: bool = True,
) -> dict[str, Any]:
    """Run the whole comparison and return its figures (also printed by ``print_report``)."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(artifact)
    prompts = chat_prompts(llm.tokenizer, num_requests)
    dtype = getattr(torch, llm.runtime.info.config.dtype)
    from kvroom.artifact.layout import hf_load_kwargs

    hf = AutoModelForCausalLM.from_pretrained(
        str(artifact), dtype=dtype, **hf_load_kwargs(artifact)
    )
    results: dict[str, Any] = {
        "artifact": str(artifact),
        "dtype": str(dtype),
        "num_requests": num_requests,
        "new_tokens": new_tokens,
        "torch_threads": torch.get_num_threads(),
    }
    bench_kvroom(llm, prompts[:2], 4)  # warm-up
    (tokens, _), secs = _timed_pair(lambda: bench_kvroom(llm, prompts, new_tokens))
    rows = [Measurement("kvroom LLM.generate", tokens, secs)]
    if "hf-padded" in peers:
        bench_hf_padded(hf, llm.tokenizer, prompts[:2], 4)
        (tokens, _), secs = _timed_pair(
            lambda: bench_hf_padded(hf, llm.tokenizer, prompts, new_tokens)
        )
        rows.append(Measurement("HF generate (padded batch)", tokens, secs))
    if "hf-batch" in peers:
        tokens, secs = timed(lambda: bench_hf_batch(hf, llm.tokenizer, prompts, new_tokens))
        rows.append(Measurement("HF generate_batch (continuous)", tokens, secs))
    results["throughput"] = [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rows]
    results["single_stream"] = _single_stream(llm, hf, prompts[0], single_stream_tokens)
    if load_test:
        n = str(llm.runtime.plan.num_blocks)
        results["load_to_first_token_s"] = load_to_first_token(
            {"kvroom": (LOAD_KVROOM, [str(artifact), n]), "hf": (LOAD_HF, [str(artifact)])}
        )
    return results


def _timed_pair(
    fn: Callable[[], tuple[int, list[list[int]]]],
) -> tuple[tuple[int, list[list[int]]], float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _single_stream(
    llm: LLM, hf: Any, prompt: list[int], new_tokens: int, repeats: int = 3
) -> dict[str, float]:
    """Median tokens/s of one request, kvroom and HF runs interleaved (the machine is shared)."""
    import torch

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = torch.tensor([prompt])

    def run_hf(n: int) -> int:
        return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False).shape[1]

    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    run_hf(4)
    kv_secs, hf_secs = [], []
    for _ in range(repeats):
        kv_secs.append(timed(lambda: len(llm.generate([prompt], params)[0].token_ids))[1])
        hf_secs.append(timed(lambda: run_hf(new_tokens))[1])
    return {
        "kvroom_tokens_per_s": new_tokens / statistics.median(kv_secs),
        "hf_tokens_per_s": new_tokens / statistics.median(hf_secs),
    }


def print_report(results: dict[str, Any]) -> None:
    rows = results["throughput"]
    base = rows[0]["tokens_per_s"]
    print(
        f"workload: {results['num_requests']} chat requests x {results['new_tokens']} new "
        f"tokens, greedy, EOS ignored; {results['dtype']}, {results['torch_threads']} threads"
    )
    print(f"{'engine':<34}{'tokens':>8}{'seconds':>10}{'tok/s':>10}{'kvroom/peer':>13}")
    for r in rows:
        ratio = base / r["tokens_per_s"]
        print(
            f"{r['name']:<34}{r['tokens']:>8}{r['seconds']:>10.2f}{r['tokens_per_s']:>10.1f}"
            f"{ratio:>12.2f}x"
        )
    s = results["single_stream"]
    print(
        f"single-stream decode: kvroom {s['kvroom_tokens_per_s']:.1f} tok/s, HF "
        f"{s['hf_tokens_per_s']:.1f} tok/s, ratio "
        f"{s['kvroom_tokens_per_s'] / s['hf_tokens_per_s']:.2f}x"
    )
    if "load_to_first_token_s" in results:
        load = results["load_to_first_token_s"]
        print(
            f"load to first token (fresh process): kvroom {load['kvroom']:.2f} s, HF "
            f"{load['hf']:.2f} s, ratio HF/kvroom {load['hf'] / load['kvroom']:.2f}x"
        )


def dump(results: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(results, indent=2) + "\n")
