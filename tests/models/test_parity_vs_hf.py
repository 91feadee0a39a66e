"""Logits parity with HF transformers on tiny random models of every supported architecture.

The oracle is one HF forward over the whole token sequence (prompt + 16 greedy tokens);
kvroom runs the same tokens step by step through the paged pool (teacher forcing), so every
prefill row and decode step is compared at 1e-4 in float32. Weights are drawn large enough
that attention is far from uniform: a wrong rotary, mask or window shows up in the logits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
import transformers

from kvroom.engine.kv.pool import KVCachePool
from kvroom.engine.model_runner import ModelRunner, load_model
from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput

BLOCK = 4
WINDOW = 4
NEW_TOKENS = 16
ATOL = 1e-4
BF16_ATOL = 0.25
"""bf16 keeps 8 mantissa bits; logits here span about +-10, so a wrong model is off by units."""
_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _configs() -> dict[str, transformers.PretrainedConfig]:
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return {
        "llama": transformers.LlamaConfig(
            **_COMMON, num_hidden_layers=2, tie_word_embeddings=True, rope_parameters=llama3_rope
        ),
        "llama_bias": transformers.LlamaConfig(
            **_COMMON, num_hidden_layers=2, tie_word_embeddings=False, attention_bias=True
        ),
        "mistral": transformers.MistralConfig(
            **_COMMON, num_hidden_layers=2, sliding_window=WINDOW, head_dim=16
        ),
        "qwen2": transformers.Qwen2Config(**_COMMON, num_hidden_layers=2),
        "qwen3": transformers.Qwen3Config(**_COMMON, num_hidden_layers=2, head_dim=32),
        "gemma3": transformers.Gemma3TextConfig(
            **_COMMON,
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
            },
        ),
    }


ARCHS = list(_configs())


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors gain nothing from threads, and a busy CI box makes OpenMP spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, str]]:
    """Per architecture: the HF model with randomised weights, and the folder it was saved to."""
    out = {}
    for name, cfg in _configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.25)
                elif "norm" in pname:
                    p.copy_((0.0 if name == "gemma3" else 1.0) + 0.2 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.2)
        folder = tmp_path_factory.mktemp(name)
        model.eval().save_pretrained(folder)
        out[name] = (model, str(folder))
    return out


@dataclass
class _Seq:
    """A sequence under test: its tokens, its blocks, and the reference logits."""

    seq_id: int
    tokens: list[int]
    prompt_len: int
    ref_logits: torch.Tensor
    blocks: list[int] = field(default_factory=list)
    done: int = 0
    """Tokens whose KV is in the pool."""


class _Harness:
    """Drives ``ModelRunner`` with hand-built ``SchedulerOutput`` s (teacher forcing)."""

    def __init__(
        self,
        hf_model: object,
        folder: str,
        max_seq_len: int = 64,
        dtype: torch.dtype = torch.float32,
        shuffle_blocks: bool = True,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.hf = hf_model
        exact = dtype == torch.float32 and kv_dtype in (None, torch.float32)
        self.atol = ATOL if exact else BF16_ATOL
        self.model = load_model(folder, dtype, "cpu")
        pool = KVCachePool(
            self.model.spec,
            num_blocks=64,
            block_size=BLOCK,
            max_seq_len=max_seq_len,
            num_sliding_slots=2,
            dtype=kv_dtype or dtype,
            device="cpu",
        )
        self.runner = ModelRunner(self.model, pool, self.model.spec, block_size=BLOCK, device="cpu")
        free = list(range(64))[::-1]
        if shuffle_blocks:
            random.Random(0).shuffle(free)
        self.free_blocks = free
        self.seqs: list[_Seq] = []

    def add(self, prompt_len: int, seed: int) -> _Seq:
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, 128, (1, prompt_len), generator=gen)
        with torch.no_grad():
            full = self.hf.generate(
                prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            ref = self.hf(full).logits[0]
        seq = _Seq(len(self.seqs), full[0].tolist(), prompt_len, ref)
        self.seqs.append(seq)
        return seq

    def chunk(self, seq: _Seq, n: int) -> ScheduledSeq:
        """The next ``n`` tokens of ``seq``, with blocks allocated to cover them."""
        end = seq.done + n
        while len(seq.blocks) * BLOCK < end:
            seq.blocks.append(self.free_blocks.pop())
        scheduled = ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=tuple(seq.tokens[seq.done : end]),
            start_pos=seq.done,
            block_table=tuple(seq.blocks),
            sliding_slot=seq.seq_id,
            needs_sample=end >= seq.prompt_len,
            sampling=SamplingParams(temperature=0.0),
        )
        seq.done = end
        return scheduled

    def step(self, *chunks: ScheduledSeq) -> None:
        """Run one step and compare the logits of every sampling row with HF."""
        sampled, logits = self.runner.compute_logits(SchedulerOutput(tuple(chunks)))
        for s, row in zip(sampled, logits, strict=True):
            pos = s.start_pos + len(s.token_ids) - 1
            ref = self.seqs[s.seq_id].ref_logits[pos]
            torch.testing.assert_close(
                row,
                ref,
                atol=self.atol,
                rtol=0,
                msg=lambda m, s=s, pos=pos: f"seq {s.seq_id} @ {pos}: {m}",
            )
        assert {s.seq_id for s in sampled} == {c.seq_id for c in chunks if c.needs_sample}

    def decode_all(self, steps: int) -> None:
        for _ in range(steps):
            self.step(*(self.chunk(s, 1) for s in self.seqs if s.done < len(s.tokens)))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode(arch: str, saved: dict) -> None:
    """A prompt longer than the window in one chunk, then 16 single-token decode steps."""
    h = _Harness(*saved[arch])
    seq = h.add(prompt_len=11, seed=1)
    h.step(h.chunk(seq, 11))
    h.decode_all(NEW_TOKENS - 1)
    assert seq.done == len(seq.tokens) - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill(arch: str, saved: dict) -> None:
    """Chunks shorter than, equal to and longer than the window, crossing block borders."""
    h = _Harness(*saved[arch])
    seq = h.add(prompt_len=15, seed=2)
    for n in (3, 1, 5, 2, 4):
        h.step(h.chunk(seq, n))
    h.decode_all(6)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch(arch: str, saved: dict) -> None:
    """Seq A decodes while seq B prefills in chunks; then both decode in one batch."""
    h = _Harness(*saved[arch])
    a = h.add(prompt_len=6, seed=3)
    b = h.add(prompt_len=13, seed=4)
    h.step(h.chunk(a, 6))
    h.step(h.chunk(b, 5), h.chunk(a, 1))
    h.step(h.chunk(a, 1), h.chunk(b, 8))
    h.decode_all(8)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_window_covering_max_seq_len_runs_as_full(arch: str, saved: dict) -> None:
    """A window >= max_seq_len never drops a token, so those layers keep block KV instead."""
    h = _Harness(*saved[arch], max_seq_len=WINDOW)
    assert set(h.runner.pool.layer_kinds) == {"full"}
    seq = h.add(prompt_len=3, seed=5)
    h.step(h.chunk(seq, 3))


def test_two_prefills_in_one_step(saved: dict) -> None:
    """Several padded prefill chunks of different lengths in one batched call."""
    h = _Harness(*saved["gemma3"])
    a, b = h.add(prompt_len=9, seed=6), h.add(prompt_len=4, seed=7)
    h.step(h.chunk(a, 9), h.chunk(b, 4))
    h.step(h.chunk(a, 1), h.chunk(b, 1))


def test_consecutive_blocks_are_read_as_a_view(saved: dict) -> None:
    """A lone decoding sequence whose blocks are consecutive skips the gather (``kv_start``)."""
    h = _Harness(*saved["llama"], shuffle_blocks=False)
    seq = h.add(prompt_len=9, seed=8)
    h.step(h.chunk(seq, 9))
    assert seq.blocks == [0, 1, 2]
    h.decode_all(6)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bfloat16_runs_close_to_hf(arch: str, saved: dict) -> None:
    """bf16 rounds differently from HF (fused kernels), so only closeness is asserted."""
    hf_model, folder = saved[arch]
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    h = _Harness(_Float32Logits(hf16.eval()), folder, dtype=torch.bfloat16)
    seq = h.add(prompt_len=7, seed=9)
    h.step(h.chunk(seq, 7))
    h.decode_all(3)


class _Float32Logits:
    """A bf16 HF model whose forward returns float32 logits (what kvroom's runner returns)."""

    def __init__(self, model: object) -> None:
        self.model = model
        self.generate = model.generate

    def __call__(self, ids: torch.Tensor) -> object:
        out = self.model(ids)
        out.logits = out.logits.float()
        return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_narrower_kv_dtype_than_the_model(arch: str, saved: dict) -> None:
    """A bf16 pool under a float32 model: K/V are rounded on store and widened on read."""
    h = _Harness(*saved[arch], kv_dtype=torch.bfloat16)
    seq = h.add(prompt_len=9, seed=10)
    h.step(h.chunk(seq, 5))
    h.step(h.chunk(seq, 4))
    h.decode_all(3)


def test_fp8_kv_pool_runs(saved: dict) -> None:
    """fp8 has no CPU index kernels; the pool is addressed through a byte view instead."""
    h = _Harness(*saved["gemma3"], kv_dtype=torch.float8_e4m3fn)
    seq = h.add(prompt_len=9, seed=11)
    for chunk in (h.chunk(seq, 9), h.chunk(seq, 1), h.chunk(seq, 1)):
        _, logits = h.runner.compute_logits(SchedulerOutput((chunk,)))
        assert torch.isfinite(logits).all()
    assert h.runner.pool.layers[0].dtype == torch.float8_e4m3fn
    assert h.runner.pool.layers[0].float().abs().sum() > 0
