"""Gemma 4's MoE block, run beside the dense MLP of each layer (``enable_moe_block``).

As transformers computes it (``Gemma4TextRouter``, ``Gemma4TextExperts``), for the residual
stream ``r`` after attention and the dense MLP output ``m``::

    x        = rms_norm(r) * scale * hidden^-0.5            router input (no norm weight)
    probs    = softmax(x @ W_router) in float32;  top-k, renormalised, x per_expert_scale
    experts  = sum_k w_k * down_e(gelu(gate_e(y)) * up_e(y)),  y = pre_norm_2(r)
    out      = post_norm_1(m) + post_norm_2(experts)

Experts run one at a time over the rows routed to them (the host reads which experts are hit).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvroom.models.decoder import _install, meta_param
from kvroom.models.layers import matmul, prepare_weight, rms_norm


class Gemma4MoE(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        h, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
        self.top_k = int(c.top_k_experts)
        self.root = h**-0.5
        self.router_scale = meta_param(h, dtype=dtype)
        self.router = meta_param(h, e, dtype=dtype)
        self.expert_scale = meta_param(e, dtype=dtype)
        self.gate_up = meta_param(e, 2 * i, h, dtype=dtype)
        """Per expert ``[2I, hidden]`` (transformers' layout, read with ``F.linear``)."""
        self.down = meta_param(e, h, i, dtype=dtype)
        self.pre_norm = meta_param(h, dtype=dtype)
        self.post_norm_1 = meta_param(h, dtype=dtype)
        self.post_norm_2 = meta_param(h, dtype=dtype)
        self.eps = torch.empty((), device="meta")

    def post_load(self, eps: torch.Tensor) -> None:
        self.eps = eps
        _install(self, "router", prepare_weight(self.router))

    def forward(self, r: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        x = rms_norm(r, self.eps) * self.router_scale * self.root
        probs = F.softmax(matmul(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, k=self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights * self.expert_scale[experts]
        y = rms_norm(r, self.eps, self.pre_norm)
        out = torch.zeros_like(y)
        for e in torch.unique(experts).tolist():
            rows, slot = torch.where(experts == e)
            gate, up = F.linear(y[rows], self.gate_up[e]).chunk(2, dim=-1)
            z = F.linear(F.gelu(gate, approximate="tanh") * up, self.down[e])
            out.index_add_(0, rows, (z * weights[rows, slot, None]).to(out.dtype))
        return rms_norm(mlp, self.eps, self.post_norm_1) + rms_norm(out, self.eps, self.post_norm_2)
