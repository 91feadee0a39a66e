"""The image budget: the image processor's config as read from a folder, its limits against
``max_image_pixels``, and what the plan pays per image (torch-free)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroom.errors import ConfigError, ModelSourceError
from kvroom.model_spec import PROCESSOR_MAX_PIXELS, PROCESSOR_MIN_PIXELS, VisionSpec
from kvroom.plan.vision import ImageBudget, image_budget, plan_vision
from kvroom.sources import read_image_processor_config

TOWER = {"hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "depth": 2}
TOWER |= {"patch_size": 16, "spatial_merge_size": 2, "out_hidden_size": 32}
TOWER |= {"deepstack_visual_indexes": [0, 1]}
"""A token is one 32x32 pixel square."""


def vision(processor: dict | None) -> VisionSpec:
    return VisionSpec.from_hf(TOWER, processor)


@pytest.mark.parametrize(
    ("processor", "limits"),
    [
        (None, (PROCESSOR_MIN_PIXELS, PROCESSOR_MAX_PIXELS)),
        ({"size": {"shortest_edge": 1024, "longest_edge": 16384}}, (1024, 16384)),
        (
            {"size": {"shortest_edge": 1024, "longest_edge": 16384}, "max_pixels": 8192},
            (1024, 8192),
        ),
        ({"min_pixels": 2048, "max_pixels": 4096}, (2048, 4096)),
        ({"size": {"min_pixels": 512, "max_pixels": 9216}}, (512, 9216)),
    ],
)
def test_processor_limits_are_read_as_transformers_applies_them(processor, limits) -> None:
    """Top-level ``min_pixels``/``max_pixels`` (the old spelling) override ``size``."""
    v = vision(processor)
    assert (v.processor_min_pixels, v.processor_max_pixels) == limits


def test_a_limit_that_is_not_a_positive_int_is_an_error() -> None:
    with pytest.raises(ModelSourceError, match="min_pixels/max_pixels must be positive ints"):
        vision({"size": {"shortest_edge": "many", "longest_edge": 16384}})


def test_the_tighter_limit_bounds_an_image() -> None:
    v = vision({"size": {"shortest_edge": 1024, "longest_edge": 16384}})
    assert image_budget(v, 512 * 512) == ImageBudget(1024, 16384, "the processor's max_pixels")
    assert image_budget(v, 4096) == ImageBudget(1024, 4096, "max_image_pixels")
    assert image_budget(v, 16384).limit == "max_image_pixels"
    with pytest.raises(ConfigError, match="max_image_pixels: 1000 is below .* min_pixels=1024"):
        image_budget(v, 1000)


def test_plan_pays_for_the_largest_image_the_processor_lets_through() -> None:
    """The issue's model: 262,144 pixels would take 256 tokens and not fit 256; its processor's
    16,384 take 16. peak = 4 B x 64 patches x (6 x 16 + 32) + 4 x 2 heads x 64^2 = 65,536;
    cache = 4 images x 16 tokens x 32 x (1 + 2) x 4 B = 24,576."""
    v = vision({"size": {"shortest_edge": 1024, "longest_edge": 16384}})
    knobs = dict(max_images_per_request=1, encoder_cache_images=4, max_seq_len=256)
    images = plan_vision(v, max_image_pixels=512 * 512, dtype="float32", **knobs)
    assert (images.tokens_per_image, images.nbytes) == (16, 65_536 + 24_576)
    assert images.budget.describe() == "at most 16384 pixels: the processor's max_pixels"
    with pytest.raises(ConfigError, match="take 256 tokens, not below max_seq_len=256"):
        plan_vision(vision(None), max_image_pixels=512 * 512, dtype="float32", **knobs)


def _write(folder: Path, name: str, doc: object) -> None:
    (folder / name).write_text(json.dumps(doc))


def test_processor_config_files(tmp_path: Path) -> None:
    """transformers 4's ``preprocessor_config.json`` first, else transformers 5's
    ``processor_config.json`` (the image part under ``image_processor``)."""
    assert read_image_processor_config(tmp_path) is None
    _write(tmp_path, "processor_config.json", {"image_processor": {"size": {"longest_edge": 9}}})
    assert read_image_processor_config(tmp_path) == {"size": {"longest_edge": 9}}
    _write(tmp_path, "preprocessor_config.json", {"size": {"longest_edge": 7}})
    assert read_image_processor_config(tmp_path) == {"size": {"longest_edge": 7}}


def test_a_processor_config_without_an_image_part_is_none(tmp_path: Path) -> None:
    _write(tmp_path, "processor_config.json", {"processor_class": "SomethingAudio"})
    assert read_image_processor_config(tmp_path) is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_broken_processor_config_is_an_error(tmp_path: Path, text: str) -> None:
    (tmp_path / "preprocessor_config.json").write_text(text)
    with pytest.raises(ModelSourceError, match="preprocessor_config.json"):
        read_image_processor_config(tmp_path)
