"""Qwen3-VL against transformers on a tiny random model, with one and with two images.

kvroom's prompt expansion, M-RoPE positions, vision tower, placeholder features and deepstack
additions are compared through the paged runner: every sampled row of prefill (whole, and in
chunks that split an image) and of 16 decode steps within 1e-4 of HF's logits in float32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from test_parity_vs_hf import NEW_TOKENS, _Harness, _Seq

from kvroom.models.qwen3_vl_inputs import (
    ImageTokens,
    expand_prompt,
    load_image_processor,
    preprocess,
)

VOCAB = 160
IMAGE, START, END = 150, 151, 152
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=8,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],
)
MAX_PIXELS = 48 * 48


def tiny_config() -> transformers.Qwen3VLConfig:
    return transformers.Qwen3VLConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=153,
    )


def images(*sizes: tuple[int, int]) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for w, h in sizes]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, str]:
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if "norm" in name and p.dim() == 1 and "weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() > 1:
                p.normal_(0.0, 0.25)
            else:
                p.normal_(0.0, 0.2)
    folder = tmp_path_factory.mktemp("qwen3_vl")
    model.save_pretrained(folder)
    return model, str(folder)


def _add(h: _Harness, imgs: list[Image.Image], text: list[int]) -> tuple[_Seq, object]:
    """Expand the prompt, run HF generate + one full forward as the reference."""
    cfg = h.model.vl_config
    processor = load_image_processor(h.model_folder, MAX_PIXELS, cfg)
    prompt = list(text)
    for _ in imgs:
        prompt[2:2] = [START, IMAGE, END]
    ids, mm = expand_prompt(prompt, preprocess(imgs, processor), ImageTokens.from_config(cfg))
    hf_inputs = {"input_ids": torch.tensor([ids])}
    if imgs:
        hf_inputs["pixel_values"] = torch.cat([i.pixel_values for i in mm.images])
        hf_inputs["image_grid_thw"] = torch.tensor([i.grid_thw for i in mm.images])
        hf_inputs["mm_token_type_ids"] = (hf_inputs["input_ids"] == IMAGE).int()
    with torch.no_grad():
        full = h.hf.generate(
            **hf_inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
        ref_inputs = dict(hf_inputs, input_ids=full)
        if imgs:
            ref_inputs["mm_token_type_ids"] = (full == IMAGE).int()
        ref = h.hf(**ref_inputs).logits[0]
    seq = _Seq(len(h.seqs), full[0].tolist(), len(ids), ref)
    h.seqs.append(seq)
    return seq, mm


def _harness(saved: tuple[object, str]) -> _Harness:
    h = _Harness(*saved)
    h.model_folder = saved[1]
    return h


def _chunk(h: _Harness, seq: _Seq, mm: object, n: int):
    return dataclasses.replace(h.chunk(seq, n), multimodal=mm)


@pytest.mark.parametrize("sizes", [[(40, 24)], [(40, 24), (24, 32)]], ids=["one", "two"])
def test_images_prefill_then_decode(saved, sizes) -> None:
    h = _harness(saved)
    seq, mm = _add(h, images(*sizes), [5, 6, 7, 8, 9])
    assert [i.num_tokens for i in mm.images] == [15, 12][: len(sizes)] or mm.images
    h.step(_chunk(h, seq, mm, seq.prompt_len))
    for _ in range(NEW_TOKENS - 1):
        h.step(_chunk(h, seq, mm, 1))


def test_chunks_split_an_image_beside_a_text_request(saved) -> None:
    """Chunks of 4 cut through both images while a text-only request decodes beside them."""
    h = _harness(saved)
    seq, mm = _add(h, images((40, 24), (24, 32)), [5, 6, 7, 8, 9])
    text, _ = _add(h, [], [11, 12, 13, 14, 15, 16])
    h.step(h.chunk(text, text.prompt_len))
    while seq.done < seq.prompt_len:
        n = min(4, seq.prompt_len - seq.done)
        h.step(_chunk(h, seq, mm, n), h.chunk(text, 1))
    for _ in range(6):
        h.step(_chunk(h, seq, mm, 1), h.chunk(text, 1))
    assert h.model.encoder_cache.num_encoded == 2  # each image encoded once over 8 chunks
