"""Tiny, randomly initialised Hugging Face model folders for tests. Nothing is downloaded.

Each ``write_tiny_*`` function writes a complete HF folder to ``path`` and returns ``path``:

- ``config.json`` + ``model.safetensors`` (``save_pretrained``, float32, seeded, so two calls with
  the same arguments give the same weights),
- ``generation_config.json`` (bos/eos/pad ids of the tokenizer),
- a byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) with exactly
  ``vocab_size`` tokens and a small chat template.

Usage::

    from tiny_models import write_tiny_llama, write_tiny_gemma3

    src = write_tiny_llama(tmp_path / "llama")                 # 2 layers, hidden 32, GQA 4/2
    src = write_tiny_llama(tmp_path / "l", num_hidden_layers=3)  # any HF config key
    src = write_tiny_gemma3(tmp_path / "gemma")                # hybrid: sliding + full layers

Tokenizer ids: ``<pad>`` = 0, ``<s>`` (bos) = 1, ``</s>`` (eos) = 2, then the 256 byte-level
symbols (ids 3..258), then two-letter merges up to ``vocab_size``. Any text encodes (byte
level) and decodes back exactly; no bos is prepended by ``encode``. The chat template renders
``<s>`` once, then ``role: content</s>`` per message, then ``assistant:`` when
``add_generation_prompt`` is set.
"""

from __future__ import annotations

import itertools
import string
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = (PAD, BOS, EOS)
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_BYTE_TOKENS
"""Smallest vocab the tokenizer supports: the specials and the 256 byte symbols (259)."""

TINY_VOCAB_SIZE = 300

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

LLAMA_TINY: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
"""Defaults of ``write_tiny_llama``: 2 layers, hidden 32, 4 heads of 8, 2 KV heads, tied."""

GEMMA3_TINY: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "query_pre_attn_scalar": 8,
    "max_position_embeddings": 128,
    "sliding_window": 8,
    "layer_types": [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    "tie_word_embeddings": True,
}
"""Defaults of ``write_tiny_gemma3``: 4 layers alternating sliding (window 8) and full."""

GEMMA4_TINY: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "vocab_size_per_layer_input": TINY_VOCAB_SIZE,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "global_head_dim": 16,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "num_kv_shared_layers": 2,
    "hidden_size_per_layer_input": 4,
    "max_position_embeddings": 128,
    "sliding_window": 8,
    "final_logit_softcapping": 30.0,
    "layer_types": [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
}
"""Defaults of ``write_tiny_gemma4``: 5 layers; full layers K=V with 1 KV head of 16 dims,
sliding layers 2 KV heads of 8 (window 8); the last 2 layers share earlier KV; PLE of 4."""

_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_TINY),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**LLAMA_TINY, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", LLAMA_TINY),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", LLAMA_TINY),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_TINY),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4_TINY),
}
"""model_type -> (transformers config class, model class, tiny defaults)."""

TINY_MODEL_TYPES = tuple(_FAMILIES)


def write_tiny_llama(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """A tiny ``LlamaForCausalLM`` folder (see ``LLAMA_TINY``); overrides are HF config keys."""
    return write_tiny_model(path, "llama", seed=seed, **config_overrides)


def write_tiny_gemma3(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """A tiny hybrid ``Gemma3ForCausalLM`` folder (see ``GEMMA3_TINY``)."""
    return write_tiny_model(path, "gemma3_text", seed=seed, **config_overrides)


def write_tiny_gemma4(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """A tiny ``Gemma4ForCausalLM`` folder (see ``GEMMA4_TINY``): K=V and KV-shared layers."""
    return write_tiny_model(path, "gemma4_text", seed=seed, **config_overrides)


def write_tiny_model(
    path: str | Path, model_type: str = "llama", *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a tiny random model of ``model_type`` (one of ``TINY_MODEL_TYPES``) to ``path``.

    ``config_overrides`` replace keys of the family's tiny defaults (any HF config key). The
    tokenizer always has exactly ``vocab_size`` tokens, so ``vocab_size`` must be at least
    ``MIN_VOCAB_SIZE``.
    """
    import torch
    import transformers

    if model_type not in _FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; one of {', '.join(_FAMILIES)}")
    config_name, model_name, defaults = _FAMILIES[model_type]
    values = {**defaults, **config_overrides}
    values.update(pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    config = getattr(transformers, config_name)(**values)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config).eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(path)
    build_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Any:
    """A ``PreTrainedTokenizerFast``: byte-level BPE with exactly ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    num_merges = vocab_size - MIN_VOCAB_SIZE
    pairs = list(itertools.product(string.ascii_lowercase, repeat=2))
    if not 0 <= num_merges <= len(pairs):
        raise ValueError(
            f"vocab_size must be in [{MIN_VOCAB_SIZE}, {MIN_VOCAB_SIZE + len(pairs)}], "
            f"got {vocab_size}"
        )
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    merges = pairs[:num_merges]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


TINY_COMPILE_CONFIG: dict[str, Any] = {
    "max_seq_len": 64,
    "batch_size": 4,
    "kvcache_block_size": 4,
    "device_memory": "1GiB",
}
"""Config of ``compile_tiny_artifact``: 16 blocks per sequence, 64 for the batch of 4; 1 GiB
holds far more, so the estimate is exactly 64 blocks on any machine."""


def compile_tiny_artifact(
    src: str | Path, out: str | Path, *, profile: bool = False, **config_overrides: Any
) -> Path:
    """``kvroom.compile.compile(src, out, TINY_COMPILE_CONFIG | overrides)``; returns ``out``.

    The profiling pass (a subprocess that loads torch, seconds per call) is off unless
    ``profile=True``: the plan then uses the runtime formula, which is what tests can compute.
    """
    from kvroom.compile import compile as kvroom_compile

    kvroom_compile(src, out, {**TINY_COMPILE_CONFIG, **config_overrides}, profile=profile)
    return Path(out)


QWEN3_VL_SPECIAL = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
"""Added after the tiny vocabulary: ids 300 .. 303."""
QWEN3_VL_TEXT: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE + len(QWEN3_VL_SPECIAL),
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}
QWEN3_VL_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "patch_size": 8,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 32,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],
}
QWEN3_VL_MAX_PIXELS = 64 * 64
"""The tiny processor's ``max_pixels``: at most (64 / 16)^2 = 16 tokens per image."""
QWEN3_VL_MIN_PIXELS = 16 * 16
"""The tiny processor's ``min_pixels``: one token."""


def write_tiny_qwen3_vl(
    path: str | Path, *, seed: int = 0, processor_file: str = "processor_config.json"
) -> Path:
    """A tiny ``Qwen3VLForConditionalGeneration`` folder with its image processor config; the
    tokenizer knows ``QWEN3_VL_SPECIAL`` (ids 300..303).

    The weights are drawn wider than transformers' init (``spread_weights``), so the greedy
    tokens have clear margins and depend on every input. The image processor normalises as
    Qwen3-VL's does (mean and std 0.5, not the Qwen2-VL class defaults) and is written as
    transformers 5 saves a processor (``processor_config.json``, the image part under
    ``image_processor``), or with ``processor_file="preprocessor_config.json"`` alone, as
    transformers 4 did."""
    import torch
    import transformers

    ids = dict(zip(("vision_start", "image", "vision_end", "video"), range(300, 304), strict=True))
    config = transformers.Qwen3VLConfig(
        text_config={**QWEN3_VL_TEXT, "pad_token_id": PAD_ID},
        vision_config=QWEN3_VL_VISION,
        **{f"{k}_token_id": v for k, v in ids.items()},
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen3VLForConditionalGeneration(config).eval()
        spread_weights(model)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(path)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN3_VL_SPECIAL)})
    tokenizer.save_pretrained(path)
    write_qwen3_vl_processor(path, QWEN3_VL_VISION, QWEN3_VL_MAX_PIXELS, processor_file)
    return path


def spread_weights(model: Any) -> None:
    """Redraw ``model``'s weights in place: matrices N(0, 0.25), norm weights 1 + N(0, 0.2),
    the rest N(0, 0.2). Attention is then far from uniform, so a wrong position, mask or
    feature moves the logits by far more than rounding does."""
    import torch

    with torch.no_grad():
        for name, p in model.state_dict().items():
            if "norm" in name and p.dim() == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() > 1:
                p.normal_(0.0, 0.25)
            elif p.is_floating_point():
                p.normal_(0.0, 0.2)


def write_qwen3_vl_processor(
    path: str | Path,
    vision: dict[str, Any],
    max_pixels: int,
    processor_file: str = "processor_config.json",
    min_pixels: int = QWEN3_VL_MIN_PIXELS,
) -> None:
    """Write a Qwen3-VL image processor config for the tower ``vision`` to ``path``: alone in
    ``preprocessor_config.json``, or under ``image_processor`` in ``processor_config.json``."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    if processor_file == "preprocessor_config.json":
        processor.save_pretrained(path)
        return
    doc = {"image_processor": processor.to_dict(), "processor_class": "Qwen3VLProcessor"}
    (Path(path) / processor_file).write_text(json.dumps(doc, indent=2, default=int))
