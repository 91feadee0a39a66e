"""Bytes of the runtime's working memory outside the KV pool and the weights (a formula).

Peak shape of one engine step: ``T = max(max_num_batched_tokens, batch_size)`` tokens in flight,
``S = batch_size`` sequences of up to ``L = max_seq_len`` tokens. With ``a`` = activation
dtype bytes and ``k`` = KV dtype bytes, per rank (heads divided by tp)::

    activations = a x T x (4 x hidden + q_dim + 2 x kv_dim + 3 x intermediate)
                   residual, norm, attn out, mlp out | qkv | gate, up, act(gate) x up
    kv_gather   = k x S x L x 2 x kv_dim          (decode reads K/V of every running sequence;
                                                int8/int4: k = row bytes / head_dim)
    scores      = 4 x heads x min(T, L) x L       (fp32 attention scores of the largest chunk)
    logits      = 4 x S x vocab x 3               (fp32 logits, probabilities, sort buffer)

``runtime_buffer_bytes = activations + kv_gather + scores + logits``. Layers run one after the
other and reuse these buffers, so they are counted once, not per layer. ``compile`` replaces this
figure by a measured one when it can run the model (see the plan's ``measured_runtime_bytes``).
"""

from __future__ import annotations

from kvroom.model_spec import ModelSpec
from kvroom.plan.kv import kv_heads_per_rank
from kvroom.units import DTYPE_BYTES, cdiv, kv_row_bytes


def runtime_buffer_bytes(
    spec: ModelSpec,
    *,
    batch_size: int,
    max_seq_len: int,
    max_num_batched_tokens: int,
    dtype: str,
    kv_dtype: str,
    tensor_parallel_size: int = 1,
) -> int:
    """The formula in this module's docstring, in bytes."""
    tokens = max(max_num_batched_tokens, batch_size)
    heads = cdiv(spec.num_heads, tensor_parallel_size)
    kv_dim = kv_heads_per_rank(spec.num_kv_heads, tensor_parallel_size) * spec.head_dim
    q_dim = heads * spec.head_dim
    intermediate = cdiv(spec.intermediate_size, tensor_parallel_size)
    per_token = 4 * spec.hidden_size + q_dim + 2 * kv_dim + 3 * intermediate
    activations = DTYPE_BYTES[dtype] * tokens * per_token
    kv_rows = batch_size * max_seq_len * 2 * kv_dim // spec.head_dim
    kv_gather = kv_rows * kv_row_bytes(kv_dtype, spec.head_dim)
    scores = 4 * heads * min(tokens, max_seq_len) * max_seq_len
    logits = 4 * batch_size * spec.vocab_size * 3
    return activations + kv_gather + scores + logits
