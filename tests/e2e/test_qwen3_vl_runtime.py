"""Qwen3-VL through the whole stack: LLM.generate with vLLM's multimodal prompts against
transformers' greedy output, preemption with images and the encoder cache, the plan's image
terms, the config pair's exclusions, and every kind of bad image input."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
import transformers
from PIL import Image

from kernel_paths import kernel_path  # noqa: F401 - a fixture
from kvroom.cli import main
from kvroom.compile import plan_model
from kvroom.config import Qwen3VLForConditionalGenerationConfig, Qwen3VLModelConfig
from kvroom.engine.params.sampling import SamplingParams
from kvroom.errors import AdmissionError, ConfigError
from kvroom.llm import LLM
from kvroom.plan.report import plan_table
from qwen3_vl_reference import hf_greedy, hf_image_inputs
from tiny_models import (
    QWEN3_VL_MAX_PIXELS,
    TINY_COMPILE_CONFIG,
    compile_tiny_artifact,
    write_tiny_qwen3_vl,
)

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def image(w: int, h: int, seed: int = 0) -> Image.Image:
    pixels = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")
    return Image.fromarray(pixels)


def _png(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("sources") / "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def vl_artifact(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "qwen3-vl"
    return compile_tiny_artifact(
        vl_dir, out, max_images_per_request=2, max_image_pixels=QWEN3_VL_MAX_PIXELS
    )


@pytest.fixture(scope="module")
def llm(vl_artifact: Path) -> LLM:
    return LLM(vl_artifact)


@pytest.fixture(scope="module")
def hf(vl_dir: Path) -> object:
    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(vl_dir).eval()


IMAGE_TOKEN, MERGE = 301, 2


def hf_reference(
    hf: object, vl_dir: Path, text: str, images: list[Image.Image]
) -> tuple[list[int], list[int], list[float]]:
    """transformers' expanded prompt, greedy tokens and their logprobs for ``text`` with
    ``images``, from the source folder's tokenizer and image processor."""
    ids = transformers.AutoTokenizer.from_pretrained(vl_dir)(text)["input_ids"]
    inputs = hf_image_inputs(vl_dir, ids, images, IMAGE_TOKEN, MERGE)
    tokens, logprobs = hf_greedy(hf, inputs, GREEDY.max_tokens)
    return inputs["input_ids"][0].tolist(), tokens, logprobs


def transparent_png(w: int, h: int) -> bytes:
    """An RGBA PNG whose alpha varies: transformers composites it onto white."""
    pixels = (np.random.default_rng(3).random((h, w, 4)) * 255).astype("uint8")
    return _png(Image.fromarray(pixels, "RGBA"))


IMAGE_CASES = {
    "one": [image(56, 40, seed=1)],
    "two": [image(56, 40, seed=1), image(32, 48, seed=2)],
    "transparent": [transparent_png(48, 40)],
}
"""A 4x8 and a 4x6 patch grid; the PNG is given as bytes, transformers gets it decoded."""


@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_generate_with_images_matches_transformers(
    vl_artifact: Path,
    vl_dir: Path,
    hf: object,
    kernel_path: str,  # noqa: F811 - the imported fixture
    case: str,
) -> None:
    """Expanded prompt, greedy tokens and their logprobs (1e-4) equal transformers'."""
    items = IMAGE_CASES[case]
    llm = LLM(vl_artifact)  # loaded on the kernel path under test
    text = "look " + " and ".join([PLACEHOLDER] * len(items)) + " what is it?"
    prompt = {"prompt": text, "multi_modal_data": {"image": items}}
    params = dataclasses.replace(GREEDY, logprobs=0)
    (result,) = llm.generate(prompt, params)
    decoded = [Image.open(io.BytesIO(i)) if isinstance(i, bytes) else i for i in items]
    ids, tokens, logprobs = hf_reference(hf, vl_dir, text, decoded)
    assert list(result.prompt_token_ids) == ids
    assert list(result.token_ids) == tokens
    got = [lp[t].logprob for lp, t in zip(result.outputs[0].logprobs, tokens, strict=True)]
    assert got == pytest.approx(logprobs, abs=1e-4)


def test_text_only_prompt_on_the_vl_model(llm, hf, vl_dir: Path) -> None:
    (result,) = llm.generate("just text", GREEDY)
    assert list(result.token_ids) == hf_reference(hf, vl_dir, "just text", [])[1]


def test_preemption_with_images_does_not_re_encode(vl_artifact: Path, llm: LLM) -> None:
    """16 blocks hold one 64-token sequence: four image requests preempt each other; outputs
    equal the unpressured run and each distinct image is encoded once (the cache holds 4)."""
    small = LLM(vl_artifact, kvcache_num_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [
        {"prompt": f"q{i} {PLACEHOLDER} ?", "multi_modal_data": {"image": image(40, 40, seed=i)}}
        for i in range(4)
    ]
    got = small.generate(prompts, params)
    want = llm.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert small.runtime.engine.stats.num_preemptions > 0
    assert small.runtime.runner.model.encoder_cache.num_encoded == 4


def test_plan_counts_the_vision_encoder_and_its_cache(llm: LLM) -> None:
    """tokens/image = 4096 / 16^2 = 16. peak = 4 B x 64 patches x (6 x 16 + 32) + 4 x 2 heads
    x 64^2 = 65_536; cache = 4 images x 16 tokens x 32 x (1 + 1 deepstack) x 4 B = 16_384."""
    plan = llm.runtime.plan
    assert plan.vision_bytes == 65_536 + 16_384
    assert llm.runtime.pool.nbytes() == plan.kv_bytes


def test_config_pair_never_saves_the_adjuster(vl_dir: Path, tmp_path: Path) -> None:
    """Each class declares its own exclusions; the adjuster's (from DecoderOnlyConfig) stays."""
    for cls in (Qwen3VLModelConfig, Qwen3VLForConditionalGenerationConfig):
        cfg = cls(kvcache_num_blocks_adjuster=lambda n, c: n // 2, image_processor=object())
        assert "kvcache_num_blocks_adjuster" not in cfg.to_dict()
        assert "image_processor" not in cfg.to_dict()
    out = compile_tiny_artifact(
        vl_dir,
        tmp_path / "half",
        max_image_pixels=QWEN3_VL_MAX_PIXELS,
        kvcache_num_blocks_adjuster=lambda n, c: n // 2,
        image_loader=lambda item: item,
    )
    doc = json.loads((out / "kvroom_config.json").read_text())
    assert doc["config_class"] == "Qwen3VLForConditionalGenerationConfig"
    assert doc["plan"]["estimated_num_blocks"] == 64 and doc["kvcache_num_blocks"] == 32
    assert not {"kvcache_num_blocks_adjuster", "image_loader"} & set(doc["config"])
    loaded = LLM(out)
    assert type(loaded.runtime.info.config) is Qwen3VLForConditionalGenerationConfig


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"image": b"not an image"}, "not a decodable image"),
        ({"image": _png(image(8, 8), "TIFF")}, "unsupported image format TIFF"),
        ({"image": [image(8, 8)] * 3}, "3 images, more than max_images_per_request=2"),
        ({"video": b""}, "only 'image' is supported"),
        ({"image": [image(8, 8)] * 2}, "2 image.s. but the prompt has 1"),
        ({"image": image(4000, 20)}, "image 0 takes 56 tokens .*more than the 16 per image"),
    ],
)
def test_bad_image_input_is_a_value_error(llm: LLM, data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt": f"x {PLACEHOLDER}", "multi_modal_data": data}, GREEDY)
    assert not llm.runtime.engine.has_unfinished()


def test_image_tokens_beyond_max_seq_len_are_refused(llm: LLM) -> None:
    prompt = {
        "prompt": "y" * 40 + PLACEHOLDER * 2,
        "multi_modal_data": {"image": [image(64, 64)] * 2},
    }
    with pytest.raises(AdmissionError, match="max_seq_len"):
        llm.generate(prompt, GREEDY)
    assert llm.runtime.engine.stats.num_free_blocks == 64


def test_image_budget_follows_the_processor(vl_dir: Path, tmp_path: Path, capsys) -> None:
    """kvroom's default max_image_pixels (262,144 pixels: 1,024 tokens) does not fit 64
    tokens, but the processor caps images at 4,096 pixels (16 tokens): the plan takes that,
    says so, and a large image runs at that size."""
    assert main(["plan", str(vl_dir), "--max-seq-len", "64", "--device-memory", "1GiB"]) == 0
    row = "tokens per image (at most 4096 pixels: the processor's max_pixels)"
    assert any(
        line.startswith(row) and line.endswith(" 16")
        for line in capsys.readouterr().out.splitlines()
    )
    llm = LLM(compile_tiny_artifact(vl_dir, tmp_path / "default-budget"))
    assert llm.runtime.plan.image_tokens == 16
    prompt = {"prompt": f"x {PLACEHOLDER}", "multi_modal_data": {"image": image(200, 120)}}
    (result,) = llm.generate(prompt, GREEDY)
    assert result.prompt_token_ids.count(IMAGE_TOKEN) <= 16


def test_max_image_pixels_tighter_than_the_processor(vl_dir: Path) -> None:
    plan = plan_model(vl_dir, {**TINY_COMPILE_CONFIG, "max_image_pixels": 1024}).plan
    assert (plan.image_tokens, plan.image_limit) == (4, "at most 1024 pixels: max_image_pixels")
    assert "tokens per image (at most 1024 pixels: max_image_pixels)" in plan_table(plan)


def test_max_image_pixels_below_the_processor_minimum_is_refused(vl_dir: Path) -> None:
    with pytest.raises(ConfigError, match="max_image_pixels: 100 is below the image processor's"):
        plan_model(vl_dir, {**TINY_COMPILE_CONFIG, "max_image_pixels": 100})
