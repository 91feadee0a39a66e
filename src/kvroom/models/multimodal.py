"""The multimodal inputs of a sequence, and the encoder cache.

A sequence's images travel with it as data (``MultimodalInputs``): the engine stores it on the
``Sequence`` and hands it to the runner with every scheduled chunk, never looking inside. The
model turns a step's chunks into ``MultimodalStep`` (M-RoPE positions, the rows that hold image
tokens and the encoder features that go there)::

    prompt:   text ... <vision_start> <image_pad> x n_j <vision_end> text ...
                                      ^ image_offsets[j]
    chunk [s, s + q) of the sequence covers image j's tokens [max(s, o_j), min(s + q, o_j + n_j))
        -> step rows  row0 + (p - s)         features  encoder_output_j[p - o_j]

A chunk may split an image (chunked prefill); after a preemption the whole prompt is computed
again and the encoder output comes from the ``EncoderCache`` instead of a second encoder run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image."""

    pixel_values: torch.Tensor
    """``[patches, channels x temporal x patch x patch]`` as the model's processor emits them."""
    grid_thw: tuple[int, int, int]
    """Patches along time, height and width."""
    num_tokens: int
    """Tokens the image takes in the prompt (after the spatial merge)."""
    key: str
    """Content hash: the encoder cache key (the same image in two requests is encoded once)."""


@dataclass(frozen=True, eq=False)
class MultimodalInputs:
    """Everything beyond token ids that the model reads for one sequence."""

    images: tuple[ImageInput, ...]
    image_offsets: tuple[int, ...]
    """Prompt index of each image's first placeholder token."""
    positions: torch.Tensor
    """``[3, prompt_len]`` (time, height, width) rotary positions of the prompt tokens."""
    position_delta: int
    """Tokens after the prompt sit at ``p + position_delta`` on all three axes."""


@dataclass(frozen=True)
class EncoderOutput:
    embeds: torch.Tensor
    """``[num_tokens, hidden]`` features that replace the placeholder embeddings."""
    deepstack: tuple[torch.Tensor, ...]
    """Per early decoder layer, ``[num_tokens, hidden]`` added after that layer."""

    @property
    def nbytes(self) -> int:
        return self.embeds.nbytes + sum(t.nbytes for t in self.deepstack)


class EncoderCache:
    """The last ``capacity`` encoder outputs, by image key (least recently used goes first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, EncoderOutput] = OrderedDict()
        self.num_encoded = 0
        """Encoder runs so far (a test counts them across a preemption)."""

    def get(
        self, image: ImageInput, encode: Callable[[ImageInput], EncoderOutput]
    ) -> EncoderOutput:
        hit = self._entries.get(image.key)
        if hit is not None:
            self._entries.move_to_end(image.key)
            return hit
        out = encode(image)
        self.num_encoded += 1
        self._entries[image.key] = out
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class MultimodalStep:
    """A step's multimodal rows: M-RoPE positions and where image features go."""

    positions: torch.Tensor
    """``[3, T]`` positions of every row (text rows: the same position on all axes)."""
    rows: torch.Tensor | None
    """Step rows holding image tokens, or None when the step has none."""
    embeds: torch.Tensor | None
    """``[R, hidden]`` encoder features of those rows."""
    deepstack: tuple[torch.Tensor, ...]
    """Per early layer ``[R, hidden]``."""


Chunk = tuple["MultimodalInputs | None", int, int]
"""(the sequence's inputs, first position of the chunk, tokens in the chunk), in row order."""


def build_step(
    chunks: Sequence[Chunk],
    positions: torch.Tensor,
    features: Callable[[ImageInput], EncoderOutput],
) -> MultimodalStep:
    """Positions and image rows of one step (``positions``: the runner's ``[T]`` positions)."""
    pos3 = positions.view(1, -1).repeat(3, 1)
    rows: list[torch.Tensor] = []
    embeds: list[torch.Tensor] = []
    deep: list[list[torch.Tensor]] = []
    row0 = 0
    for mm, start, n in chunks:
        if mm is not None:
            _place_positions(pos3, mm, row0, start, n)
            for image, offset in zip(mm.images, mm.image_offsets, strict=True):
                lo, hi = max(start, offset), min(start + n, offset + image.num_tokens)
                if lo >= hi:
                    continue
                out = features(image)
                rows.append(torch.arange(row0 + lo - start, row0 + hi - start))
                embeds.append(out.embeds[lo - offset : hi - offset])
                deep.append([d[lo - offset : hi - offset] for d in out.deepstack])
        row0 += n
    if not rows:
        return MultimodalStep(pos3, None, None, ())
    device = positions.device
    return MultimodalStep(
        pos3,
        torch.cat(rows).to(device),
        torch.cat(embeds),
        tuple(torch.cat(layer) for layer in zip(*deep, strict=True)),
    )


def _place_positions(
    pos3: torch.Tensor, mm: MultimodalInputs, row0: int, start: int, n: int
) -> None:
    """Prompt rows take the precomputed 3-D positions; later rows are shifted by the delta."""
    prompt_len = mm.positions.shape[1]
    end = min(start + n, prompt_len)
    if start < end:
        pos3[:, row0 : row0 + end - start] = mm.positions[:, start:end].to(pos3.device)
    if start + n > prompt_len:
        first = max(start, prompt_len)
        pos3[:, row0 + first - start : row0 + n] += mm.position_delta
