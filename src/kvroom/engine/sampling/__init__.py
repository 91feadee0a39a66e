"""Logits -> tokens: penalties, sampler, logprobs.

``SamplingParams`` lives in ``kvroom.engine.params``; it is re-exported here because
``from kvroom.engine.sampling import SamplingParams`` is a documented import path.
"""

from kvroom.engine.params.sampling import MAX_LOGPROBS, SamplingParams

__all__ = ["MAX_LOGPROBS", "SamplingParams"]
