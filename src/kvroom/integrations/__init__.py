"""Hand an artifact to another engine. ``vllm``: engine arguments, ``vllm serve`` flags, launcher.

Nothing here imports the other engine: it runs in its own environment (vLLM pins its own
torch and transformers), so kvroom only computes arguments and starts a process.
"""

from __future__ import annotations
