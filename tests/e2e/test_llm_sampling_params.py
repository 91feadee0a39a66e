"""vLLM's sampling parameters through ``LLM.generate`` on the tiny artifact.

The references are plain torch over one full forward of the same weights (transformers'
model), so logprobs, penalties and bias are checked against what they mean, not against
themselves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvroom.engine.params.sampling import SamplingParams
from kvroom.errors import ConfigError
from kvroom.llm import LLM

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]


@pytest.fixture(scope="module")
def llm(tiny_artifact: Path) -> LLM:
    return LLM(tiny_artifact)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def full_logprobs(hf, tokens: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("budget", [512, 7])
def test_prompt_logprobs_match_a_full_forward_across_chunks(llm: LLM, hf, budget: int) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    scheduler = llm.runtime.engine.scheduler
    scheduler.max_num_batched_tokens = budget  # 7: the 19-token prompt takes three chunks
    try:
        result = llm.generate([PROMPT, [3, 4]], params)[0]
    finally:
        scheduler.max_num_batched_tokens = 512
    ref = full_logprobs(hf, PROMPT)
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    assert len(result.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = result.prompt_logprobs[pos]
        assert entry is not None
        token = PROMPT[pos]
        assert entry[token].logprob == pytest.approx(ref[pos - 1, token].item(), abs=1e-4)
        top = ref[pos - 1].topk(3).indices.tolist()
        assert [t for t in entry if t != token or entry[t].rank == 1][:3] == top or token in top


def test_logprobs_of_generated_tokens_are_the_raw_model_output(llm: LLM, hf) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    ref = full_logprobs(hf, PROMPT + list(out.token_ids))
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(PROMPT) - 1 + i]
        assert entry[token].rank == 1  # greedy
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert list(entry) == row.topk(2).indices.tolist()
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_n_choices_are_independent_and_seeded_per_choice(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    first = llm.generate([PROMPT], params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert len({o.token_ids for o in first.outputs}) > 1
    again = llm.generate([PROMPT], params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    one = llm.generate(
        [PROMPT], SamplingParams(temperature=1.0, seed=8, max_tokens=6, ignore_eos=True)
    )
    assert one[0].token_ids == first.outputs[1].token_ids  # choice i uses seed + i


def test_best_of_returns_the_n_most_likely(llm: LLM) -> None:
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    result = llm.generate([PROMPT], params)[0]
    assert len(result.outputs) == 2
    assert result.outputs[0].cumulative_logprob is None  # not asked for
    wide = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, logprobs=0)
    all4 = sorted(llm.generate([PROMPT], wide)[0].outputs, key=lambda o: -o.cumulative_logprob)
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in all4[:2]]


def test_logit_bias_forces_a_token(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, logit_bias={42: 100.0}, ignore_eos=True)
    assert llm.generate([PROMPT], params)[0].token_ids == (42,) * 5


def test_repetition_and_frequency_penalties_change_greedy_output(llm: LLM, hf) -> None:  # noqa: ANN001
    plain = llm.generate([[7] * 8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for kwargs in (
        {"repetition_penalty": 5.0},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
    ):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kwargs)
        out = llm.generate([[7] * 8], params)[0].token_ids
        assert out != plain[0].token_ids, kwargs
    # first token under repetition_penalty, by hand: only token 7 was seen
    params = SamplingParams(temperature=0, max_tokens=1, repetition_penalty=5.0, ignore_eos=True)
    with torch.no_grad():
        raw = hf(torch.tensor([[7] * 8])).logits[0, -1].clone()
    raw[7] = raw[7] / 5.0 if raw[7] > 0 else raw[7] * 5.0
    assert llm.generate([[7] * 8], params)[0].token_ids == (int(raw.argmax()),)


def test_min_tokens_masks_stop_token_ids(llm: LLM) -> None:
    first = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    stop_now = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first])
    assert llm.generate([PROMPT], stop_now)[0].token_ids == (first,)
    held = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first], min_tokens=3)
    out = llm.generate([PROMPT], held)[0].token_ids
    assert len(out) >= 3 and first not in out[:3]


def test_min_p_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    params = SamplingParams(temperature=1.0, min_p=1.0, seed=1, max_tokens=6, ignore_eos=True)
    assert llm.generate([PROMPT], params)[0].token_ids == greedy[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=f"SamplingParams.{field}:"):
        SamplingParams(**kwargs)
