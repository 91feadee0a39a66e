"""The measured process of the profiling pass: ``python -m kvroom.profile_process ARTIFACT``.

It runs what a deployment runs, in the same order (imports, tokenizer, weights, pool and
engine, peak-shape steps, then the server's app), and prints the ``MeasuredTerms`` as JSON
(see ``kvroom.profiling`` for the method). It sits above every layer because it loads the
server too; ``compile`` only starts it as a subprocess (``profiling.measure_terms``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from kvroom import heap
from kvroom.artifact.layout import read_info
from kvroom.engine.sched.output import SchedulerOutput
from kvroom.plan.measured import IN_TURN, MeasuredTerms
from kvroom.profiling import (
    IN_TURN_ROUNDS,
    MEASURED_ROUNDS,
    CpuProbe,
    CudaProbe,
    churn_steps,
    fill_steps,
    peak_steps,
    round_order,
)


class _Stages:
    """Reads the probe around each stage: ``delta`` (resident change) and ``over`` (how far
    the stage's peak rose above its end state)."""

    def __init__(self, probe: CpuProbe | CudaProbe) -> None:
        self.probe = probe

    @contextlib.contextmanager
    def stage(self, out: dict[str, int], name: str) -> Any:
        self.probe.reset_peak()
        before = self.probe.current()
        yield
        after = self.probe.current()
        out[name] = after - before
        out[name + "_over"] = max(self.probe.peak() - after, 0)

    def step_peak(self, run: Any, baseline: int) -> int:
        heap.trim()
        self.probe.reset_peak()
        run()
        return max(self.probe.peak() - baseline, 0)


def profile(folder: Path) -> MeasuredTerms:
    """The profiling pass, in this process."""
    info = read_info(folder)
    cuda = str(info.config.device).startswith("cuda")
    got: dict[str, int] = {}
    import torch
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401 - what LLM imports

    import kvroom.llm  # noqa: F401 - the deployment's modules count in process_bytes
    from kvroom.engine.model_runner import load_model
    from kvroom.models.layers import packed_bf16_bytes, widens_bf16_weights
    from kvroom.runtime import assemble_runtime

    heap.configure()
    probe: CpuProbe | CudaProbe = CudaProbe(torch) if cuda else CpuProbe()
    stages = _Stages(probe)
    if cuda:
        torch.empty(1, device=info.config.device)  # create the context
        got["process"] = probe.context_bytes()
    else:
        got["process"] = probe.current()
    with stages.stage(got, "tokenizer"):  # host memory: 0 on CUDA
        tokenizer = _load_tokenizer(folder)
    dtype = getattr(torch, info.config.dtype)
    with stages.stage(got, "weights"):
        model = load_model(folder, dtype, info.config.device, info.config.quantization)
    plan = info.plan.with_num_blocks(info.config.num_min_blocks, "profile")
    with stages.stage(got, "engine"):
        runtime = assemble_runtime(info, plan, model, tokenizer=tokenizer)
        runtime.engine.heap_guard = None  # the pass measures the heap as the steps leave it
        runtime.pool.touch()  # a lazily zeroed CPU pool is resident only where touched
    pool_bytes = runtime.pool.nbytes()
    steps = peak_steps(info, runtime.spec.vocab_size)
    fill = fill_steps(info, runtime.spec.vocab_size) + churn_steps(info, runtime.spec.vocab_size)
    peaks = _run_steps(stages, runtime, steps, fill, got)
    server = 0 if cuda else _server_bytes(stages, runtime, list(steps.values()))
    load_over = max(got["tokenizer_over"] - got["weights"], got["weights_over"], 0)
    bf16 = not cuda and dtype == torch.bfloat16
    file_backed = 0 if cuda else probe.file_backed()
    return MeasuredTerms(
        method="cuda" if cuda else "cpu-rss",
        process_bytes=got["process"],
        tokenizer_bytes=got["tokenizer"],
        weights_bytes=got["weights"],
        load_transient_bytes=load_over,
        engine_bytes=max(got["engine"] - pool_bytes, 0),
        warmup_bytes=got["warmup"],
        step_peak_bytes=peaks,
        server_bytes=server,
        bf16_projection_bytes=packed_bf16_bytes(model) if bf16 else 0,
        bf16_widened=bf16 and widens_bf16_weights(),
        file_backed_bytes=file_backed,
    )


def _load_tokenizer(folder: Path) -> Any:
    """The tokenizer as ``LLM`` loads it, with the chat template applied once."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    ids = tokenizer("The plan is the truth.")["input_ids"]
    tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer


def _run_steps(
    stages: _Stages,
    runtime: Any,
    steps: dict[str, SchedulerOutput],
    fill: list[SchedulerOutput],
    got: dict[str, int],
) -> dict[str, int]:
    """Warm up on every shape once and on the cache-filling steps, then the largest peak of
    each shape over ``MEASURED_ROUNDS`` rounds in rotating order (``round_order``), counted
    from the resident state after warm-up (so growth between rounds counts); then ``IN_TURN``:
    the peak of ``IN_TURN_ROUNDS`` rounds over every shape with no trim between the steps.

    The heap is trimmed (``heap.trim``) after the warm-up and before each measured step, so a
    step's transients count in full as fresh pages: otherwise they may be served from free
    memory the warm-up left in the heap, or not, depending on where the free chunks lie (one
    SmolLM2 artifact profiled warm-up + step at 75-79 MB in some processes and 100-115 MB in
    others); the trimmed reading is the larger, which a deployment can reach."""
    execute = runtime.runner.execute
    with stages.stage(got, "warmup"):
        for step in [*steps.values(), *fill]:
            execute(step)
        _generate_once(runtime)
        heap.trim()
    baseline = stages.probe.current()
    peaks = dict.fromkeys(steps, 0)
    for r in range(MEASURED_ROUNDS):
        for name in round_order(list(steps), r):
            peak = stages.step_peak(lambda s=steps[name]: execute(s), baseline)
            peaks[name] = max(peaks[name], peak)

    def in_turn() -> None:
        for r in range(IN_TURN_ROUNDS):
            for name in round_order(list(steps), r):
                execute(steps[name])

    peaks[IN_TURN] = stages.step_peak(in_turn, baseline)
    return peaks


def _generate_once(runtime: Any) -> None:
    """Two requests through ``LLM.generate`` (text and token ids, greedy and seeded top-p with
    a stop string and logprobs): the scheduler, block manager, sampler, detokenizer and
    output code a deployment runs above the model runner, resident from their first use."""
    from kvroom.engine.params.sampling import SamplingParams
    from kvroom.llm import LLM

    llm = LLM.from_runtime(runtime)
    new = max(1, min(8, runtime.info.config.max_seq_len // 4))
    greedy = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    topp = SamplingParams(
        temperature=0.8,
        top_p=0.95,
        seed=1,
        max_tokens=new,
        ignore_eos=True,
        stop=("\n\n",),
        logprobs=1,
    )
    vocab = runtime.spec.vocab_size
    llm.generate(["The plan is the truth.", [t % vocab for t in range(3, 3 + new)]], [greedy, topp])
    llm.reset_prefix_cache()


def _server_bytes(stages: _Stages, runtime: Any, peak_steps: list[SchedulerOutput]) -> int:
    """``kvroom serve``'s own memory: its modules, the app ``create_app`` builds, and what the
    running app holds once it has served (the engine loop, the tokenizer workers, the routes'
    lazily built state), measured while the app's lifespan runs.

    The server steps the engine on a thread of its own, and the kernels keep state per thread
    (likely the OpenMP team and oneDNN's scratchpad; a workload run again on a second thread
    added 27 MiB on SmolLM2), so the peak shapes run once more on that thread: the offline
    warm-up on the main thread does not cover it."""
    import asyncio

    got: dict[str, int] = {}
    loop = asyncio.new_event_loop()
    with stages.stage(got, "server"):
        import uvicorn

        from kvroom.llm import LLM
        from kvroom.server.app import create_app

        app = create_app(LLM.from_runtime(runtime), served_model_name="profile")
        # what `serve` loads before it listens: the protocol, loop and lifespan modules
        uvicorn.Config(app, loop="asyncio", http="h11", lifespan="on").load()
        lifespan = app.router.lifespan_context(app)
        loop.run_until_complete(lifespan.__aenter__())
        execute = runtime.runner.execute
        app.state.kvroom.engine.run_between_steps(lambda _: [execute(s) for s in peak_steps])
        loop.run_until_complete(_serve_once(app))
    loop.run_until_complete(lifespan.__aexit__(None, None, None))
    loop.close()
    del app  # held until the stage read the resident set
    return max(got["server"] + got["server_over"], 0)


async def _serve_once(app: Any) -> None:
    """One streamed chat completion and one completion through the app, as a client sends."""
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://profile") as client:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=chat) as reply:
            async for _ in reply.aiter_bytes():
                pass
        await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        await client.get("/metrics")


if __name__ == "__main__":
    print(json.dumps(profile(Path(sys.argv[1])).to_dict()))
