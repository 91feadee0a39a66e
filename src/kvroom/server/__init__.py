"""OpenAI-compatible HTTP server over one ``LLMEngine`` (``kvroom serve``).

- ``openai/``: the OpenAI API itself: pydantic protocol (the only pydantic in kvroom), prompts,
  response and stream formats, tools, structured outputs, tokenize, images;
- ``app``: the FastAPI routes: validate, tokenize, submit, stream back;
- ``admin``, ``auth``, ``limits``, ``cache_routes``: operator routes and request guards;
- ``async_engine``: the engine loop (one thread that owns the engine and the KV pool) and the
  per-request ``asyncio.Queue`` streams;
- ``metrics``: Prometheus collectors over the engine's stats, in a per-app registry.

Nothing is imported here, so ``import kvroom.server.openai.protocol`` stays free of torch.
"""

from __future__ import annotations
