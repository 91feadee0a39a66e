"""Qwen3-VL against transformers on tiny random models, with images, on both kernel paths.

Each shape of the model is run through kvroom's paged runner (teacher forcing on transformers'
greedy tokens) and compared with one transformers forward over prompt + 16 generated tokens:
every sampled row within 1e-4 of transformers' logits in float32, and its argmax is
transformers' token. transformers preprocesses with its own image processor read from the
source folder and expands the placeholders itself, so kvroom's processor loading, prompt
expansion, M-RoPE positions, vision tower inputs and deepstack additions are all checked.

The shapes cover: a learned position grid that every image grid resamples and one that a
square image's grid equals; deepstack from every vision layer and from one; M-RoPE sections
with ``mrope_interleaved`` true and false (transformers' Qwen3-VL interleaves either way);
square, wide and tall images, one and two per prompt; prefill chunks that end inside an image;
a preempted sequence recomputed from its first token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from test_parity_vs_hf import ATOL, NEW_TOKENS, _Harness, _Seq

from kernel_paths import kernel_path  # noqa: F401 - a fixture
from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput
from kvroom.models.qwen3_vl_inputs import (
    ImageTokens,
    expand_prompt,
    load_image_processor,
    preprocess,
)
from qwen3_vl_reference import hf_image_inputs
from tiny_models import spread_weights, write_qwen3_vl_processor

VOCAB = 160
IMAGE, START, END = 150, 151, 152
TEXT_PROMPT = [5, 6, 7, 8, 9]
MAX_PIXELS = 64 * 64
"""No image here is scaled down: 48x48, 64x32 and 32x48 are all below it."""
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
MERGE = 2
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=8,
    temporal_patch_size=2,
    spatial_merge_size=MERGE,
    out_hidden_size=64,
)
SHAPES = {
    # A 4x4 position grid: every image grid below (6x6, 4x8, 6x4) is resampled from it.
    "resampled-grid,deepstack-all,interleaved": (
        {"num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]},
        {"mrope_section": [2, 3, 3], "mrope_interleaved": True},
        "processor_config.json",
    ),
    # A 6x6 grid: a 48x48 image's 6x6 patches take it as it is; deepstack from one layer.
    "exact-grid,deepstack-one,not-interleaved": (
        {"num_position_embeddings": 36, "deepstack_visual_indexes": [1]},
        {"mrope_section": [4, 2, 2], "mrope_interleaved": False},
        "preprocessor_config.json",
    ),
}
IMAGES = {
    "square": [(48, 48)],
    "wide": [(64, 32)],
    "two": [(48, 48), (32, 48)],
}
"""Images as (width, height): patch grids 6x6, 4 rows x 8 columns, and 6x6 + 6 rows x 4."""


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors gain nothing from threads, and a busy CI box makes OpenMP spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(SHAPES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """transformers' model of one shape and the folder it was saved to, with its processor."""
    vision, rope, processor_file = SHAPES[request.param]
    rope_parameters = {"rope_type": "default", "rope_theta": 1000.0, **rope}
    config = transformers.Qwen3VLConfig(
        text_config={**TEXT, "rope_parameters": rope_parameters},
        vision_config={**VISION, **vision},
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=153,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    spread_weights(model)
    folder = tmp_path_factory.mktemp("qwen3_vl")
    model.save_pretrained(folder)
    write_qwen3_vl_processor(folder, config.vision_config.to_dict(), MAX_PIXELS, processor_file)
    return model, str(folder)


def images(sizes: list[tuple[int, int]]) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for w, h in sizes]


class _VLHarness(_Harness):
    """``_Harness`` whose prompts carry images, and whose sampled tokens are checked too."""

    def __init__(self, saved: tuple[object, str]) -> None:
        super().__init__(*saved)
        self.folder = Path(saved[1])
        self.multimodal: dict[int, object] = {}

    def add_images(self, imgs: list[Image.Image], text: list[int]) -> _Seq:
        """transformers' greedy tokens and logits for ``text`` with ``imgs`` after its second
        token, its inputs built by transformers' own processor; kvroom's expansion must agree."""
        prompt = list(text)
        for _ in imgs:
            prompt[2:2] = [START, IMAGE, END]
        hf_inputs = hf_image_inputs(self.folder, prompt, imgs, IMAGE, MERGE)
        cfg = self.model.vl_config
        processor = load_image_processor(self.folder, MAX_PIXELS, cfg)
        ids, mm = expand_prompt(prompt, preprocess(imgs, processor), ImageTokens.from_config(cfg))
        assert ids == hf_inputs["input_ids"][0].tolist()
        with torch.no_grad():
            full = self.hf.generate(
                **hf_inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            extra = {"mm_token_type_ids": (full == IMAGE).int()} if imgs else {}
            ref = self.hf(**{**hf_inputs, "input_ids": full, **extra}).logits[0]
        seq = _Seq(len(self.seqs), full[0].tolist(), len(ids), ref)
        self.seqs.append(seq)
        self.multimodal[seq.seq_id] = mm if imgs else None
        return seq

    def chunk(self, seq: _Seq, n: int, *, sample: bool = False) -> ScheduledSeq:
        """The next ``n`` tokens with the sequence's images; ``sample``: compare this chunk's
        last row even inside the prompt."""
        scheduled = dataclasses.replace(
            super().chunk(seq, n), multimodal=self.multimodal.get(seq.seq_id)
        )
        return dataclasses.replace(scheduled, needs_sample=True) if sample else scheduled

    def step(self, *chunks: ScheduledSeq) -> None:
        """Run one step: each sampled row within ``ATOL`` of transformers' logits, and its
        argmax transformers' next token where that is a generated one."""
        sampled, logits = self.runner.compute_logits(SchedulerOutput(tuple(chunks)))
        assert {s.seq_id for s in sampled} == {c.seq_id for c in chunks if c.needs_sample}
        for s, row in zip(sampled, logits, strict=True):
            seq, pos = self.seqs[s.seq_id], s.start_pos + len(s.token_ids) - 1
            where = f"seq {s.seq_id} @ {pos}"
            torch.testing.assert_close(
                row, seq.ref_logits[pos], atol=ATOL, rtol=0, msg=lambda m, w=where: f"{w}: {m}"
            )
            if seq.prompt_len <= pos + 1 < len(seq.tokens):
                assert int(row.argmax()) == seq.tokens[pos + 1], where

    def preempt(self, seq: _Seq) -> None:
        """Free the sequence's blocks; its tokens are computed again from the first."""
        self.free_blocks.extend(seq.blocks)
        seq.blocks, seq.done = [], 0


@pytest.fixture
def harness(saved, kernel_path: str) -> _VLHarness:  # noqa: F811 - the imported fixture
    """A fresh runner over the shape's folder, loaded on the kernel path under test."""
    return _VLHarness(saved)


@pytest.mark.parametrize("shape", list(IMAGES))
def test_prefill_then_decode(harness: _VLHarness, shape: str) -> None:
    h = harness
    seq = h.add_images(images(IMAGES[shape]), TEXT_PROMPT)
    h.step(h.chunk(seq, seq.prompt_len))
    for _ in range(NEW_TOKENS - 1):
        h.step(h.chunk(seq, 1))
    assert h.model.encoder_cache.num_encoded == len(IMAGES[shape])


def test_chunks_end_inside_images_beside_a_text_request(harness: _VLHarness) -> None:
    """Chunks of 4 end inside both images (each compared) while a text request decodes."""
    h = harness
    seq = h.add_images(images(IMAGES["two"]), TEXT_PROMPT)
    text = h.add_images([], [11, 12, 13, 14, 15, 16])
    h.step(h.chunk(text, text.prompt_len))
    inside = 0
    while seq.done < seq.prompt_len:
        n = min(4, seq.prompt_len - seq.done)
        inside += seq.tokens[seq.done + n - 1] == IMAGE and seq.tokens[seq.done + n] == IMAGE
        h.step(h.chunk(seq, n, sample=True), h.chunk(text, 1))
    assert inside >= 2  # both images were cut
    for _ in range(6):
        h.step(h.chunk(seq, 1), h.chunk(text, 1))
    assert h.model.encoder_cache.num_encoded == 2  # each image encoded once over the chunks


def test_preempted_sequence_is_recomputed_without_re_encoding(harness: _VLHarness) -> None:
    """Preempted after 6 tokens, the sequence recomputes prompt + generated tokens in chunks
    of 5 (positions past the prompt shifted by its M-RoPE delta), then decodes on."""
    h = harness
    seq = h.add_images(images(IMAGES["two"]), TEXT_PROMPT)
    h.step(h.chunk(seq, seq.prompt_len))
    for _ in range(5):
        h.step(h.chunk(seq, 1))
    computed = seq.done
    h.preempt(seq)
    while seq.done < computed:
        h.step(h.chunk(seq, min(5, computed - seq.done), sample=True))
    while seq.done < len(seq.tokens) - 1:
        h.step(h.chunk(seq, 1))
    assert h.model.encoder_cache.num_encoded == 2
