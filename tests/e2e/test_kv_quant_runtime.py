"""int8/int4 KV end to end on tiny models: plan equals allocation, prefix caching and ``n``
(shared blocks), live resize with migration, Gemma 4's K=V and shared layers; every repeat
gives the tokens of the first run, and the logits stay near those of a float32 pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvroom import LLM, SamplingParams
from kvroom.engine import key_shift
from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput
from tiny_models import (
    compile_tiny_artifact,
    write_tiny_gemma3,
    write_tiny_gemma4,
    write_tiny_llama,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[3 + i, 40 + i, 7, 9 + 2 * i, 11, 12, 13, 14, 15, 16, 17, 18, 19] for i in range(3)]


@pytest.fixture(scope="module")
def llama64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head dim 64 (a Hadamard block): 2 heads, 1 KV head."""
    src = tmp_path_factory.mktemp("sources") / "llama64"
    return write_tiny_llama(
        src, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64
    )


def _artifact(src: Path, root: Path, kv_dtype: str, **kw: object) -> Path:
    return compile_tiny_artifact(src, root / f"{src.name}-{kv_dtype}", kv_dtype=kv_dtype, **kw)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_pool_serves_caches_shares_and_resizes(
    llama64: Path, tmp_path: Path, kv_dtype: str
) -> None:
    llm = LLM(_artifact(llama64, tmp_path, kv_dtype))
    plan, pool = llm.runtime.plan, llm.runtime.pool
    assert pool.kv_codec is not None and pool.kv_codec.rotate
    assert pool.nbytes() == plan.kv_bytes and pool.bytes_per_block == plan.kv_bytes_per_block
    first = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    again = llm.generate(PROMPTS, GREEDY)  # prompts' full blocks now come from the cache
    assert [r.token_ids for r in again] == first
    pair = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, n=2))
    assert [c.token_ids for c in pair[0].outputs] == [first[0], first[0]]
    llm.resize_kv_cache(pool.num_blocks // 2)  # live blocks migrate, scales with them
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == first


def test_int8_logits_stay_near_float32_and_rotation_is_off_on_request(
    llama64: Path, tmp_path: Path
) -> None:
    ids = PROMPTS[0] + PROMPTS[1]
    ref = _logprobs(LLM(_artifact(llama64, tmp_path, "float32")), ids)
    plain = LLM(_artifact(llama64, tmp_path / "plain", "int8", kv_rotation="none"))
    assert plain.runtime.pool.kv_codec is not None and not plain.runtime.pool.kv_codec.rotate
    for llm in (LLM(_artifact(llama64, tmp_path, "int8")), plain):
        diff = (_logprobs(llm, ids) - ref).abs().max()
        assert 0 < diff < 0.05


def test_int4_measures_its_key_shift_at_start_up(llama64: Path, tmp_path: Path) -> None:
    """The int4 runtime's key shift is the mean of the calibration prompt's keys past its
    first positions: layer 0's (whose keys do not depend on the pool) equals the mean key a
    float32 pool holds after the same prompt, up to int4 rounding; int8 keeps no shift."""
    llm = LLM(_artifact(llama64, tmp_path, "int4"))
    shifts = [layer.key_shift for layer in llm.runtime.runner.model.layers]
    assert all(s is not None and s.shape == (1, 64) for s in shifts)
    ref = LLM(_artifact(llama64, tmp_path, "float32"))
    n = 64  # min(CALIBRATION_TOKENS, max_num_batched_tokens, max_seq_len 64)
    gen = torch.Generator().manual_seed(key_shift.CALIBRATION_SEED)
    ids = torch.randint(0, ref.runtime.spec.vocab_size, (n,), generator=gen).tolist()
    table = tuple(range(n // 4))
    seq = ScheduledSeq(0, tuple(ids), 0, table, None, False, SamplingParams())
    ref.runtime.runner.compute_logits(SchedulerOutput((seq,)))
    keys = ref.runtime.pool.layers[0].flatten(0, 1)[key_shift.CALIBRATION_SKIP : n, 0]
    want = keys.mean(0)
    assert (shifts[0] - want).norm() < 0.2 * want.norm()  # vs layer 1 or the values: 1.1-1.5x
    int8 = LLM(_artifact(llama64, tmp_path, "int8"))
    assert all(layer.key_shift is None for layer in int8.runtime.runner.model.layers)


def _logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Log-probability of each prompt token after the ones before it."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    got = llm.generate([ids], params)[0].prompt_logprobs[1:]
    return torch.tensor([d[t].logprob for d, t in zip(got, ids[1:], strict=True)])


@pytest.mark.parametrize(
    ("family", "kv_dtype"),
    [("gemma3", "int8"), ("gemma3", "int4"), ("gemma4", "int4")],
    ids=["gemma3", "gemma3-int4", "gemma4"],
)
def test_sliding_rings_and_k_eq_v_layers_run_quantized(
    tmp_path: Path, family: str, kv_dtype: str
) -> None:
    """Gemma 3 with head dim 64 (its sliding rings rotated and quantized; int4: a key shift on
    every layer, sliding ones measured from their ring), Gemma 4's K=V and KV-shared layers (V
    quantized unrotated, no key shift): logits near a float32 pool's, repeats equal."""
    if family == "gemma3":
        src = write_tiny_gemma3(tmp_path / family, head_dim=64, max_position_embeddings=128)
    else:
        src = write_tiny_gemma4(tmp_path / family)
    llm = LLM(_artifact(src, tmp_path, kv_dtype))
    assert llm.runtime.pool.nbytes() == llm.runtime.plan.kv_bytes
    shifts = [getattr(layer, "key_shift", None) for layer in llm.runtime.runner.model.layers]
    shifted = family == "gemma3" and kv_dtype == "int4"
    assert all((s is not None and s.abs().sum() > 0) == shifted for s in shifts)
    ids = PROMPTS[0] + PROMPTS[1]  # longer than the window of 4 (gemma3) or 8 (gemma4)
    ref = _logprobs(LLM(_artifact(src, tmp_path, "float32")), ids)
    near = {"int8": 0.05, "int4": 0.25}[kv_dtype]  # log-probabilities here are about -5.7
    assert 0 < (_logprobs(llm, ids) - ref).abs().max() < near
    first = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == first
