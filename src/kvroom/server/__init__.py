"""OpenAI-compatible HTTP server over one ``LLMEngine`` (``kvroom serve``).

Modules, in the order a request flows through them:

- ``protocol``: pydantic request/response schemas and the OpenAI error body (the only pydantic
  in kvroom);
- ``app``: the FastAPI routes: validate, tokenize, submit, stream back;
- ``async_engine``: the engine loop (one thread that owns the engine and the KV pool) and the
  per-request ``asyncio.Queue`` streams;
- ``metrics``: Prometheus collectors over the engine's stats, in a per-app registry.

Nothing is imported here, so ``import kvroom.server.protocol`` stays free of torch.
"""

from __future__ import annotations
