"""Qwen3-VL through the whole stack: LLM.generate with vLLM's multimodal prompts against
transformers' greedy output, preemption with images and the encoder cache, the plan's image
terms, the config pair's exclusions, and every kind of bad image input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from kvroom.config import Qwen3VLForConditionalGenerationConfig, Qwen3VLModelConfig
from kvroom.engine.params.sampling import SamplingParams
from kvroom.errors import AdmissionError
from kvroom.llm import LLM
from tiny_models import QWEN3_VL_MAX_PIXELS, compile_tiny_artifact, write_tiny_qwen3_vl

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def image(w: int, h: int, seed: int = 0) -> Image.Image:
    pixels = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")
    return Image.fromarray(pixels)


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


def hf_greedy(hf: object, ids: tuple[int, ...], llm: LLM, images: list[Image.Image]) -> list[int]:
    """transformers' greedy tokens for the expanded prompt kvroom ran."""
    model = llm.runtime.runner.model
    inputs = {"input_ids": torch.tensor([ids])}
    if images:
        from kvroom.models.qwen3_vl_inputs import preprocess

        pre = preprocess(images, model.processor)
        inputs["pixel_values"] = torch.cat([p.pixel_values for p in pre])
        inputs["image_grid_thw"] = torch.tensor([p.grid_thw for p in pre])
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == 301).int()
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("num_images", [1, 2])
def test_generate_with_images_matches_transformers(llm, hf, num_images: int) -> None:
    images = [image(56, 40, seed=1), image(32, 48, seed=2)][:num_images]
    prompt = {
        "prompt": "look " + " and ".join([PLACEHOLDER] * num_images) + " what is it?",
        "multi_modal_data": {"image": images if num_images > 1 else images[0]},
    }
    (result,) = llm.generate(prompt, GREEDY)
    assert result.prompt_token_ids.count(301) > num_images  # placeholders were expanded
    assert list(result.token_ids) == hf_greedy(hf, result.prompt_token_ids, llm, images)


def test_text_only_prompt_on_the_vl_model(llm, hf) -> None:
    (result,) = llm.generate("just text", GREEDY)
    assert list(result.token_ids) == hf_greedy(hf, result.prompt_token_ids, llm, [])


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


def _png(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"image": b"not an image"}, "not a decodable image"),
        ({"image": _png(image(8, 8), "TIFF")}, "unsupported image format TIFF"),
        ({"image": [image(8, 8)] * 3}, "3 images, more than max_images_per_request=2"),
        ({"video": b""}, "only 'image' is supported"),
        ({"image": [image(8, 8)] * 2}, "2 image.s. but the prompt has 1"),
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
