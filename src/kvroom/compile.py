"""Build an artifact: source -> ModelSpec -> memory plan -> profiling -> policy -> files.

The device is probed before any weight is loaded, so the plan sees the memory a fresh
process would have. The num-blocks policy (manual value or adjuster) runs once, on the plan
that uses the measured runtime memory when the profiling pass ran.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroom.adjust import require_estimate_fits, resolve_num_blocks
from kvroom.artifact.layout import ArtifactInfo
from kvroom.config import DecoderOnlyConfig, config_class_for
from kvroom.device import resolve_device_memory
from kvroom.model_spec import ModelSpec
from kvroom.plan import MemoryPlan, compute_plan
from kvroom.sources import ModelSource, resolve_source

logger = logging.getLogger("kvroom")


@dataclass(frozen=True)
class PlannedModel:
    """A resolved source with its spec and a plan (no weights loaded yet)."""

    source: ModelSource
    spec: ModelSpec
    config: DecoderOnlyConfig
    plan: MemoryPlan

    @property
    def keeps_gguf(self) -> bool:
        """The source is a GGUF file whose blocks the artifact keeps as shipped."""
        return self.source.gguf_file is not None and self.config.quantization is None

    def info(self, folder: Path, plan: MemoryPlan | None = None) -> ArtifactInfo:
        model = {
            "architecture": self.spec.architecture,
            "num_parameters": self.source.num_parameters,
            "source": self.source.name,
        }
        plan = plan or self.plan
        return ArtifactInfo(folder, self.config, plan, model).with_plan(plan)


def as_config(
    config: DecoderOnlyConfig | Mapping[str, Any] | None, architecture: str | None = None
) -> DecoderOnlyConfig:
    """``config`` as the config class ``architecture`` needs (``config.config_class_for``);
    a plain ``DecoderOnlyConfig`` given for such an architecture is widened with defaults."""
    cls = config_class_for(architecture) if architecture else DecoderOnlyConfig
    if isinstance(config, cls):
        return config
    if isinstance(config, DecoderOnlyConfig):
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls(**fields)
    return cls(**dict(config or {}))


def plan_model(
    model: str | Path,
    config: DecoderOnlyConfig | Mapping[str, Any] | None = None,
    *,
    apply_policy: bool = True,
) -> PlannedModel:
    """Resolve ``model`` and fit the KV pool (runtime memory from the formula).

    With ``apply_policy``, the manual value or the adjuster is applied and the outcome logged.

    Raises:
        ModelSourceError, ConfigError, MemoryNotEnoughError, AdjusterError.
    """
    source = resolve_source(model, check_config=ModelSpec.from_hf_config)
    spec = ModelSpec.from_hf_config(source.hf_config, source.image_processor)
    cfg = as_config(config, spec.architecture)
    memory = resolve_device_memory(cfg.device, cfg.device_memory)
    plan = compute_plan(
        spec,
        cfg,
        num_parameters=source.num_parameters,
        memory=memory,
        weight_types=_weight_types(source, cfg),
    )
    if apply_policy:
        plan = resolve_num_blocks(plan, cfg)
        logger.info(plan.summary_line(pin_hint=True))
    return PlannedModel(source, spec, cfg, plan)


def _weight_types(source: ModelSource, cfg: DecoderOnlyConfig) -> dict[str, int] | None:
    """Resident bytes per kind of tensor where weights are not all in the model dtype: a GGUF
    kept as shipped, or a ``--quantization`` scheme (None: every weight in ``cfg.dtype``).

    Raises:
        ModelSourceError: a truncated GGUF, or a block type kvroom does not run.
    """
    from kvroom import gguf_file, quant_schemes

    if cfg.quantization not in (None, *quant_schemes.SCHEMES):
        return None
    if source.gguf_file is None:
        if cfg.quantization is None:
            return None
        tied = bool(source.hf_config.get("tie_word_embeddings", False))
        files = sorted(source.folder.glob("*.safetensors"))
        shapes = quant_schemes.safetensors_shapes(files, tied)
        return quant_schemes.resident_bytes_by_type(shapes, cfg.quantization, cfg.dtype)
    header = gguf_file.read_gguf(source.folder / source.gguf_file)
    if cfg.quantization is None:
        return gguf_file.resident_bytes_by_type(header.tensors, cfg.dtype)
    shapes = gguf_file.hf_shapes(header.tensors)
    return quant_schemes.resident_bytes_by_type(shapes, cfg.quantization, cfg.dtype)


def load_hf_model(planned: PlannedModel) -> tuple[Any, Any]:
    """The source's transformers model (in the artifact dtype) and tokenizer."""
    import transformers
    from transformers import AutoTokenizer

    from kvroom.artifact.writer import torch_dtype

    src = planned.source
    tokenizer = AutoTokenizer.from_pretrained(str(src.folder), **src.hf_kwargs)
    auto = "AutoModelForImageTextToText" if planned.spec.vision else "AutoModelForCausalLM"
    model = getattr(transformers, auto).from_pretrained(
        str(src.folder), dtype=torch_dtype(planned.config.dtype), **src.hf_kwargs
    )
    return model, tokenizer


def compile(  # noqa: A001 - the verb users expect, as in `kvroom compile`
    model: str | Path,
    out: str | Path,
    config: DecoderOnlyConfig | Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
    profile: bool = True,
) -> ArtifactInfo:
    """Plan ``model``, write the artifact to ``out``, profile it, and record the chosen pool.

    Args:
        profile: run the profiling pass (``kvroom.profiling``) and fit with its measured
            terms instead of the formula.
    """
    from kvroom.artifact.writer import check_output_folder, write_artifact

    planned = plan_model(model, config, apply_policy=False)
    check_output_folder(Path(out), overwrite=overwrite)  # before the (slow) weight load
    if planned.config.kvcache_num_blocks is None:
        # Fail before loading weights when no measurement could make one sequence fit.
        require_estimate_fits(planned.plan.with_measured_runtime(0))
    hf_model, tokenizer = shipped_gguf(planned) if planned.keeps_gguf else load_hf_model(planned)

    def finalize(folder: Path) -> ArtifactInfo:
        _copy_processor_files(planned.source.folder, folder)
        plan = planned.plan
        if profile:
            from kvroom.profiling import measure_terms

            plan = plan.with_measured(measure_terms(folder))
        plan = resolve_num_blocks(plan, planned.config)
        logger.info(plan.summary_line(pin_hint=True))
        return planned.info(folder, plan)

    return write_artifact(
        Path(out),
        model=hf_model,
        tokenizer=tokenizer,
        info=planned.info(Path(out), _provisional(planned.plan)),
        overwrite=overwrite,
        finalize=finalize,
    )


def _provisional(plan: MemoryPlan) -> MemoryPlan:
    """The plan the folder holds until ``finalize``: at least one full-length sequence, so
    the profiling pass can load it even where the formula's runtime term leaves no room (the
    measured one may, and the policy then decides)."""
    return plan.with_num_blocks(max(plan.num_blocks, plan.num_min_blocks), plan.num_blocks_source)


def shipped_gguf(planned: PlannedModel) -> tuple[Any, Any]:
    """The GGUF file to copy as it is, with the configs and tokenizer its header gives."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from kvroom.artifact.writer import ShippedGguf

    src = planned.source
    assert src.gguf_file is not None
    config = AutoConfig.from_pretrained(str(src.folder), **src.hf_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(src.folder), **src.hf_kwargs)
    generation = GenerationConfig.from_model_config(config)
    return ShippedGguf(src.folder / src.gguf_file, config, generation), tokenizer


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.jinja")
"""Files of a multimodal source the artifact keeps beside the tokenizer's."""


def _copy_processor_files(source: Path, folder: Path) -> None:
    import shutil

    for name in PROCESSOR_FILES:
        if (source / name).is_file() and not (folder / name).exists():
            shutil.copyfile(source / name, folder / name)
