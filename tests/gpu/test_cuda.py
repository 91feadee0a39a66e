"""The default model on CUDA (``make test-cuda``; skipped without a GPU).

* the pool allocates exactly the plan's KV bytes;
* logits match HF transformers on the same weights in float16 and bfloat16;
* the plan's weight + KV figures against ``torch.cuda.max_memory_reserved`` after a batch;
* ``kvroom serve`` on a CUDA artifact answers a completion.

The artifacts are compiled here (``kvroom compile smollm2-135m --device cuda``) with a small
pool, so the check fits in a few minutes on any CUDA GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.real_model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NUM_BLOCKS = 256
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def cuda_artifact(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from kvroom.compile import compile as kvroom_compile

    out = tmp_path_factory.mktemp(f"cuda-{request.param}") / "smollm2-135m"
    options = {"device": "cuda", "dtype": request.param, "kvcache_num_blocks": NUM_BLOCKS}
    options["quantization"] = "none"  # dense, as transformers runs it
    kvroom_compile("smollm2-135m", out, options)
    return out, getattr(torch, request.param)


def test_pool_bytes_equal_the_plan(cuda_artifact) -> None:
    from kvroom.llm import LLM

    llm = LLM(cuda_artifact[0])
    rt = llm.runtime
    assert rt.pool.nbytes() == rt.plan.kv_bytes
    assert rt.pool.layers[0].device.type == "cuda"
    assert rt.plan.num_blocks == NUM_BLOCKS


def test_logits_match_transformers(cuda_artifact) -> None:
    from transformers import AutoModelForCausalLM

    from kvroom.engine.params.sampling import SamplingParams
    from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput
    from kvroom.llm import LLM

    folder, dtype = cuda_artifact
    llm = LLM(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to("cuda").eval()
    for i, prompt in enumerate(PROMPTS):
        ids = llm.tokenizer.encode(prompt)
        seq = ScheduledSeq(
            seq_id=100 + i,
            token_ids=tuple(ids),
            start_pos=0,
            block_table=tuple(range(-(-len(ids) // 16))),
            sliding_slot=0,
            needs_sample=True,
            sampling=SamplingParams(temperature=0.0),
        )
        _, logits = llm.runtime.runner.compute_logits(SchedulerOutput(seqs=(seq,)))
        with torch.no_grad():
            ref = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
        err = (logits[0] - ref).abs().max().item()
        assert err < 0.05 * ref.abs().max().item(), f"{prompt!r}: max |diff| {err}"
        assert logits[0].argmax().item() == ref.argmax().item()


def test_plan_against_max_memory_reserved(cuda_artifact) -> None:
    from kvroom.engine.params.sampling import SamplingParams
    from kvroom.llm import LLM

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    llm = LLM(cuda_artifact[0])
    llm.generate(PROMPTS * 8, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    plan = llm.runtime.plan
    reserved = torch.cuda.max_memory_reserved() - base
    print(
        f"\nplan: weights {plan.weight_bytes / 2**20:.1f} MiB + KV {plan.kv_bytes / 2**20:.1f} MiB "
        f"+ runtime {plan.runtime_bytes / 2**20:.1f} MiB = {plan.total_bytes / 2**20:.1f} MiB; "
        f"torch.cuda.max_memory_reserved {reserved / 2**20:.1f} MiB"
    )
    assert reserved >= plan.weight_bytes + plan.kv_bytes
    assert reserved <= plan.total_bytes * 1.1 + 64 * 2**20


def test_serve_answers(cuda_artifact) -> None:
    cmd = [sys.executable, "-m", "kvroom", "serve", str(cuda_artifact[0]), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = _wait_for_address(proc, timeout_s=120)
        body = {"model": "smollm2-135m", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
        assert reply["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _wait_for_address(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The ``http://127.0.0.1:PORT`` of serve's start-up line, once ``/health`` answers."""
    from e2e.server_harness import ADDRESS_LINE  # tests/ is on sys.path (pytest pythonpath)

    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        match = ADDRESS_LINE.search(line)
        if match:
            url = match.group(1)
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5):
                        return url
                except OSError:
                    time.sleep(0.5)
        if time.monotonic() > deadline:
            break
    pytest.fail("kvroom serve did not start")
