"""Logprobs of sampled and prompt tokens under the raw model output (vLLM's default).

``log_softmax`` of the logits as the model produced them, before penalties, logit bias,
temperature or top-k/top-p: the numbers lm-eval's loglikelihood and OpenAI clients expect,
and what vLLM reports unless ``logprobs_mode`` says otherwise. One batched ``log_softmax``,
``gather`` and ``topk`` for every row that asks, then one host copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvroom.engine.sched.output import TokenLogprobs


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Logprob, rank and top ``num_top[i]`` alternatives of ``token_ids[i]`` under row ``i``.

    Args:
        logits: ``[R, vocab]`` raw logits.
        token_ids: ``[R]`` the token whose logprob each row reports.
        num_top: per row, how many of the most likely tokens to list (0 for none).
    """
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, token_ids[:, None])
    ranks = (lp > chosen).sum(dim=-1) + 1
    k = max(num_top, default=0)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], token_ids[:, None][:, :0])
    return [
        TokenLogprobs(t, c, r, tuple(zip(ids[:n], lps[:n], strict=True)))
        for t, c, r, ids, lps, n in zip(
            token_ids.tolist(),
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_lp.tolist(),
            num_top,
            strict=True,
        )
    ]
