"""The engine: requests in, tokens out, inside the KV pool the plan sized.

Rooms, from the bottom up (``import-linter`` keeps the arrows pointing down):

- ``params``: what a request asks for (``SamplingParams``, ``StructuredOutputsParams``), torch-free;
- ``kv``: the KV pool's whole life: allocate, share, cache, migrate, resize, follow memory;
- ``sched``: sequences, admission, continuous batching and preemption inside the pool;
- ``sampling``: logits -> tokens (penalties, sampler, logprobs);
- ``structured``: grammar-constrained decoding;
- this folder: the step loop (``engine``, ``model_runner``, ``detokenizer``).
"""
