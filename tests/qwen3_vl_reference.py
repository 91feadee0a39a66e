"""transformers' side of the Qwen3-VL comparisons, built without any kvroom code.

``Qwen3VLProcessor`` needs torchvision (its video processor), so its image half is done here
as it does it: the folder's image processor (``from_pretrained``: ``preprocessor_config.json``
or ``processor_config.json``) makes the pixels and grids, and each ``<|image_pad|>`` becomes
``t x h x w / merge^2`` of itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_image_inputs(
    folder: str | Path, prompt_ids: list[int], images: list[Any], image_token: int, merge: int
) -> dict[str, torch.Tensor]:
    """Model inputs for ``prompt_ids`` (one ``image_token`` per image) and PIL ``images``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if not images:
        return {"input_ids": torch.tensor([prompt_ids])}
    out = Qwen2VLImageProcessorPil.from_pretrained(str(folder))(images=images, return_tensors="pt")
    counts = iter((out["image_grid_thw"].prod(-1) // merge**2).tolist())
    ids = [t for tok in prompt_ids for t in ([tok] * next(counts) if tok == image_token else [tok])]
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "pixel_values": out["pixel_values"],
        "image_grid_thw": out["image_grid_thw"],
        "mm_token_type_ids": (input_ids == image_token).int(),
    }


def hf_greedy(
    model: Any, inputs: dict[str, torch.Tensor], new_tokens: int
) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after the prompt and the logprob of each."""
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[t])
        for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs
