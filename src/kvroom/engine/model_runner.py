"""Model runner: one ``SchedulerOutput`` in, one sampled token per sampling sequence out.

``execute`` packs the step's tokens (single-token decodes first, then prefill chunks, whatever
order the scheduler used), builds the ``AttentionMetadata`` once, runs one forward, computes
logits only at the rows that sample, and samples. Nothing in the layer loop syncs with the
host; the only sync is reading the sampled tokens back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvroom.engine.kv.pool import KVCachePool
from kvroom.engine.sampling.prompt_logprobs import Found, PromptLogprobs, wants_prompt_logprobs
from kvroom.engine.sampling.sampler import Sampler
from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput, StepResult
from kvroom.engine.structured.grammar import GrammarCompiler
from kvroom.engine.structured.masks import StepMasks, StructuredOutputs
from kvroom.errors import ModelSourceError
from kvroom.model_spec import ModelSpec
from kvroom.models import build_model
from kvroom.models.attention_index import SeqChunk, build_attention_metadata
from kvroom.models.decoder import DecoderModel
from kvroom.models.weights import load_weights


class ModelRunner:
    """Runs a loaded model over the KV pool for the scheduler's steps."""

    def __init__(
        self,
        model: DecoderModel,
        pool: KVCachePool,
        spec: ModelSpec,
        *,
        block_size: int,
        device: torch.device | str,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """Args:
        model: a model built by ``load_model`` (weights on ``device``).
        pool: the KV pool; its block size must be ``block_size``.
        spec: the model's shapes.
        block_size: tokens per block of the full-attention pool.
        device: where the model and the pool live.
        grammars: the engine's grammar compiler, for structured outputs (None: none served).
        """
        assert pool.block_size == block_size, "pool and runner disagree on block_size"
        self.model = model
        self.pool = pool
        self.spec = spec
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(self.device)
        self.prompt_logprobs = PromptLogprobs()
        self.structured = StructuredOutputs(grammars) if grammars is not None else None
        self._found_prompt_logprobs: Found = {}
        """Prompt logprobs of the forward in progress (set by ``compute_logits``)."""

    def execute(self, output: SchedulerOutput) -> StepResult:
        """Run one step.

        Returns:
            ``seq_id -> sampled token`` for every scheduled sequence with ``needs_sample``,
            with the logprobs that the sequences' params ask for.
        """
        self.sampler.history.record(output.seqs)
        masks = self._begin_masks(output)
        seqs, logits = self.compute_logits(output)
        prompt_logprobs, self._found_prompt_logprobs = self._found_prompt_logprobs, {}
        if not seqs:
            return StepResult({}, prompt_logprobs=prompt_logprobs)
        if masks is not None:
            self._structured().apply(masks, logits)
        tokens, logprobs = self.sampler.sample_step(logits, seqs)
        if masks is not None:
            self._structured().accept(masks, tokens)
        self.pool.start_populating()
        sampled = {s.seq_id: t for s, t in zip(seqs, tokens, strict=True)}
        return StepResult(sampled, logprobs, prompt_logprobs)

    @torch.inference_mode()
    def compute_logits(self, output: SchedulerOutput) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Forward one step; float32 logits ``[N, vocab]`` of the N sequences that sample."""
        if output.block_copies:
            self.pool.copy_blocks(output.block_copies)
        seqs = _decodes_first(output.seqs)
        if not seqs:
            return [], torch.empty(0, self.spec.vocab_size, device=self.device)
        input_ids, positions, sample_rows = _pack(seqs)
        meta = build_attention_metadata(
            [SeqChunk(s.start_pos, len(s.token_ids), s.block_table, s.sliding_slot) for s in seqs],
            layer_kinds=self.pool.layer_kinds,
            block_size=self.block_size,
            sliding_window=self.pool.sliding_window,
            dtype=self.model.dtype,
            device=self.device,
            kv_codec=self.pool.kv_codec,
        )
        extra = {}
        if any(s.multimodal is not None for s in seqs):
            extra["multimodal"] = [(s.multimodal, s.start_pos, len(s.token_ids)) for s in seqs]
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.pool.layers,
            meta,
            **extra,
        )
        if any(wants_prompt_logprobs(s) for s in seqs):
            self._found_prompt_logprobs = self.prompt_logprobs.compute(
                seqs, hidden, self.model.compute_logits
            )
        sampled = sampling_seqs(output)
        if not sampled:
            return [], hidden.new_empty(0, self.spec.vocab_size, dtype=torch.float32)
        if len(sample_rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_rows, device=self.device)]
        return sampled, self.model.compute_logits(hidden)

    def release(self, seq_id: int) -> None:
        """Drop per-sequence runner state (generator, grammar matcher) of a finished sequence."""
        self.sampler.release(seq_id)
        self.prompt_logprobs.release(seq_id)
        if self.structured is not None:
            self.structured.release(seq_id)

    def _begin_masks(self, output: SchedulerOutput) -> StepMasks | None:
        """Start the grammar masks of the step's constrained sequences (before the forward)."""
        if self.structured is None:
            return None
        return self.structured.begin(sampling_seqs(output))

    def _structured(self) -> StructuredOutputs:
        assert self.structured is not None
        return self.structured


def sampling_seqs(output: SchedulerOutput) -> list[ScheduledSeq]:
    """The sequences that sample this step, in the order of their logits rows."""
    return [s for s in _decodes_first(output.seqs) if s.needs_sample]


def _decodes_first(seqs: tuple[ScheduledSeq, ...]) -> list[ScheduledSeq]:
    """Single-token chunks first (one batched decode group), longer chunks after, both stable."""
    return [s for s in seqs if len(s.token_ids) == 1] + [s for s in seqs if len(s.token_ids) > 1]


def _pack(seqs: list[ScheduledSeq]) -> tuple[list[int], list[int], list[int]]:
    """Token ids, positions, and the row of each sampling sequence's last token."""
    input_ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    for s in seqs:
        n = len(s.token_ids)
        input_ids.extend(s.token_ids)
        positions.extend(range(s.start_pos, s.start_pos + n))
        if s.needs_sample:
            sample_rows.append(len(input_ids) - 1)
    return input_ids, positions, sample_rows


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str | None = None,
) -> DecoderModel:
    """Build the model of a HF folder (``config.json`` + ``*.safetensors`` or ``model.gguf``)
    on ``device``, its projections quantized with ``quantization`` (``kvroom.quant_schemes``).

    Raises:
        ModelSourceError: no ``config.json``, an unsupported architecture, or missing weights.
    """
    from transformers import AutoConfig

    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"{folder}: no config.json")
    spec = ModelSpec.from_hf_config(json.loads(config_file.read_text()))
    hf_config = AutoConfig.from_pretrained(folder)
    model = build_model(spec, hf_config, dtype, device)
    load_weights(model, folder, quantization)
    return model
