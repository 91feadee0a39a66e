"""Sampler: greedy, top-k, top-p, temperature, and seeded reproducibility."""

from __future__ import annotations

import torch

from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sampling.sampler import Sampler, filtered_probs, mix_seed

GREEDY = SamplingParams(temperature=0.0)


def _logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(sampler: Sampler, logits: torch.Tensor, params, ids=None, gen=None) -> list[int]:
    n = logits.shape[0]
    return sampler.sample(logits, params, ids or list(range(n)), gen or [0] * n)


def test_greedy_is_argmax() -> None:
    logits = _logits()
    assert _sample(Sampler("cpu"), logits, [GREEDY] * 6) == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_even_with_temperature() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=1.5, top_k=1)] * 6
    assert _sample(Sampler("cpu"), logits, params) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = _logits()
    params = [GREEDY, SamplingParams(seed=1)] * 3
    out = _sample(Sampler("cpu"), logits, params)
    assert out[0::2] == logits[0::2].argmax(-1).tolist()


def test_seed_reproducible_across_samplers_and_batch_composition() -> None:
    logits = _logits(vocab=1000)
    params = [SamplingParams(temperature=1.0, seed=42)]
    alone = [_sample(Sampler("cpu"), logits[3:4], params, [7], [k]) for k in range(20)]
    batched = [
        _sample(
            Sampler("cpu"), logits, [SamplingParams()] * 3 + params + [GREEDY] * 2, None, [k] * 6
        )[3]
        for k in range(20)
    ]
    assert [a[0] for a in alone] == batched
    other = [
        _sample(Sampler("cpu"), logits[3:4], [SamplingParams(seed=43)], [7], [k]) for k in range(20)
    ]
    assert other != alone


def test_release_forgets_the_generator() -> None:
    sampler = Sampler("cpu")
    _sample(sampler, _logits(1), [SamplingParams(seed=1)], [5])
    assert 5 in sampler._generators
    sampler.release(5)
    assert 5 not in sampler._generators


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = filtered_probs(probs.log(), [SamplingParams(top_p=0.6)])
    torch.testing.assert_close(out, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    sampler = Sampler("cpu")
    drawn = {
        _sample(sampler, probs.log(), [SamplingParams(top_p=0.6, seed=s)])[0] for s in range(200)
    }
    assert drawn == {0, 1}


def test_top_p_always_keeps_the_most_likely_token() -> None:
    out = filtered_probs(torch.tensor([[0.0, 5.0, 1.0]]), [SamplingParams(top_p=0.01)])
    assert out.tolist() == [[0.0, 1.0, 0.0]]


def test_top_k_keeps_k_tokens_per_row() -> None:
    logits = _logits(rows=3)
    params = [SamplingParams(top_k=k) for k in (2, 5, 0)]
    kept = (filtered_probs(logits, params) > 0).sum(-1).tolist()
    assert kept == [2, 5, 50]


def test_temperature_scales_logits() -> None:
    logits = _logits(rows=2)
    out = filtered_probs(logits, [SamplingParams(temperature=0.5), SamplingParams(temperature=2.0)])
    expected = torch.stack([(logits[0] / 0.5).softmax(-1), (logits[1] / 2.0).softmax(-1)])
    torch.testing.assert_close(out, expected)


def test_mix_seed_separates_neighbours() -> None:
    values = {mix_seed(s, k) for s in range(10) for k in range(10)}
    assert len(values) == 100
    assert all(0 <= v < 2**63 for v in values)
