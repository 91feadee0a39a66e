"""Model registry: every supported architecture resolves; others fail with the list."""

from __future__ import annotations

import pytest

from kvroom.errors import ModelSourceError
from kvroom.model_spec import SUPPORTED_ARCHITECTURES
from kvroom.models import REGISTRY, model_class
from kvroom.models.decoder import DecoderModel
from kvroom.models.gemma3 import Gemma3Model


def test_registry_covers_every_supported_architecture() -> None:
    assert set(REGISTRY) == set(SUPPORTED_ARCHITECTURES)
    assert model_class("Qwen3ForCausalLM") is DecoderModel
    assert model_class("Gemma3ForCausalLM") is Gemma3Model


def test_unknown_architecture_lists_the_supported_ones() -> None:
    expected = "unsupported architecture 'GPT2LMHeadModel'; supported: " + ", ".join(
        SUPPORTED_ARCHITECTURES
    )
    with pytest.raises(ModelSourceError) as err:
        model_class("GPT2LMHeadModel")
    assert str(err.value) == expected
