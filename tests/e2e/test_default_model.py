"""The real default model (SmolLM2-135M-Instruct, fp32) against HF transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvroom.cli import main
from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Why is the sky blue? Explain briefly, in simple words, for a child of seven.",
    "Hi",
    "List two planets of the solar system and say which one is larger, with a reason.",
]


@pytest.fixture(scope="module")
def smol_artifact(smol_fp32_artifact: Path) -> Path:
    return smol_fp32_artifact


def test_greedy_equals_hf_generate_for_a_mixed_batch(smol_artifact: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(smol_artifact)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) > 4  # mixed lengths
    # Both stop at EOS (HF's min_new_tokens would instead forbid EOS, a different decoding).
    params = SamplingParams(temperature=0.0, max_tokens=32)  # 8 prompts x 32 keeps the suite short
    ours = [list(r.token_ids) for r in llm.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(str(smol_artifact), dtype=torch.float32)
    for prompt, got in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, max_new_tokens=32, do_sample=False)
        assert got == want[0, len(prompt) :].tolist()
    assert sum(len(o) for o in ours) > 8 * 12  # real answers, not an early EOS everywhere
    assert llm.runtime.engine.stats.num_free_blocks == 256


def test_run_answers_a_question(smol_artifact: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(
        [
            "run",
            str(smol_artifact),
            "--prompt",
            "What is the capital of France?",
            "--max-new-tokens",
            "24",
        ]
    )
    assert code == 0
    assert "Paris" in capsys.readouterr().out
