"""Prefix caching and shared blocks on the tiny random models: same greedy tokens as without,
with the prefill skipped where the counters say so."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroom import LLM, SamplingParams

SYSTEM = [(7 * i) % 97 + 3 for i in range(26)]  # 26 tokens: 6 full blocks of 4 and 2 more
QUESTIONS = [[5, 9, 11], [13, 2], [40, 41, 42, 43, 44]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def cached(tiny_artifact: Path) -> LLM:
    return LLM(tiny_artifact)


@pytest.fixture(scope="module")
def uncached(tiny_artifact: Path) -> LLM:
    return LLM(tiny_artifact, enable_prefix_caching=False)


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[tuple]:
    return [tuple(o.token_ids for o in r.outputs) for r in llm.generate(prompts, params)]


def test_on_by_default_and_off_when_asked(cached: LLM, uncached: LLM) -> None:
    assert cached.engine.prefix_caching and not uncached.engine.prefix_caching


def test_a_shared_system_prompt_hits_the_cache_with_the_same_greedy_tokens(
    cached: LLM, uncached: LLM
) -> None:
    prompts = [SYSTEM + q for q in QUESTIONS]
    want = tokens(uncached, prompts)
    before = cached.engine.stats
    assert tokens(cached, prompts[:1]) == want[:1]
    assert tokens(cached, prompts[1:]) == want[1:], "later requests reuse the system prompt"
    after = cached.engine.stats
    assert after.num_prefix_cache_hits - before.num_prefix_cache_hits >= 2 * 24
    queries = after.num_prefix_cache_queries - before.num_prefix_cache_queries
    assert queries == sum(len(p) for p in prompts)
    assert uncached.engine.stats.num_prefix_cache_queries == 0


def test_multi_turn_chat_reuses_the_previous_turn(cached: LLM, uncached: LLM) -> None:
    first = SYSTEM + QUESTIONS[0]
    answer = list(cached.generate([first], GREEDY)[0].token_ids)
    follow_up = first + answer + [17, 18]
    hits = cached.engine.stats.num_prefix_cache_hits
    assert tokens(cached, [follow_up]) == tokens(uncached, [follow_up])
    computed = len(first) + len(answer) - 1  # the last sampled token was never fed back
    assert cached.engine.stats.num_prefix_cache_hits - hits == computed // 4 * 4


def test_n_choices_share_the_prompt_which_is_prefilled_once(cached: LLM, uncached: LLM) -> None:
    prompt = SYSTEM + [60, 61, 62]  # 29 tokens: the last block is partial
    params = SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True)
    cached.reset_prefix_cache()
    forked = cached.engine.stats.num_forked_tokens
    got = tokens(cached, [prompt], params)
    assert got == tokens(uncached, [prompt], params)
    assert len(set(got[0])) == 1, "greedy choices agree"
    assert cached.engine.stats.num_forked_tokens - forked == 2 * (len(prompt) - 1)
    assert uncached.engine.stats.num_forked_tokens == 2 * (len(prompt) - 1), "not the cache"


def test_reset_prefix_cache_empties_it(cached: LLM) -> None:
    prompt = SYSTEM + [70]
    cached.generate([prompt], GREEDY)
    assert cached.reset_prefix_cache() > 0
    hits = cached.engine.stats.num_prefix_cache_hits
    cached.generate([prompt], GREEDY)
    assert cached.engine.stats.num_prefix_cache_hits == hits
    stats = cached.engine.stats
    assert stats.num_free_blocks == stats.num_total_blocks


def test_prompt_logprobs_are_computed_even_for_a_cached_prompt(cached: LLM, uncached: LLM) -> None:
    prompt = SYSTEM + [80, 81]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    cached.generate([prompt], GREEDY)
    got = cached.generate([prompt], params)[0].prompt_logprobs
    want = uncached.generate([prompt], params)[0].prompt_logprobs
    assert got is not None and want is not None and got[0] is None
    assert len(got) == len(want) == len(prompt)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.keys() == w.keys()
        assert all(g[k].logprob == pytest.approx(w[k].logprob, abs=1e-4) for k in g)


def test_a_small_pool_evicts_and_preempts_with_the_same_tokens(
    tiny_artifact: Path, uncached: LLM
) -> None:
    small = LLM(tiny_artifact, kvcache_num_blocks=16)
    prompts = [SYSTEM + [90 + i] * 6 for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert tokens(small, prompts, params) == tokens(uncached, prompts, params)
    assert small.engine.stats.num_preemptions > 0
    assert small.engine.stats.num_prefix_cache_hits > 0


def test_sliding_window_models_keep_caching_off(tiny_gemma3_artifact: Path) -> None:
    llm = LLM(tiny_gemma3_artifact)
    assert not llm.engine.prefix_caching
    params = SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True)
    got = llm.generate([SYSTEM], params)[0]
    assert got.outputs[0].token_ids == got.outputs[1].token_ids
    assert llm.engine.stats.num_forked_tokens == 0
