"""Shared builders for the model tests: configs from the repo's YAML presets and packed document batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from track_1_short.model.config import ModelConfig
from track_1_short.model.gpt import GPT

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "model"
BOS = 50256


def load_config(name: str, **overrides) -> ModelConfig:
    """configs/model/<name>.yaml merged onto the ModelConfig schema, plus overrides, as a ModelConfig."""
    node = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(CONFIGS / f"{name}.yaml"), overrides
    )
    return OmegaConf.to_object(node)


def packed_batch(doc_lens: list[int], seed: int = 0, vocab: int = 50257):
    """One packed sequence of BOS-led documents: (inputs int32 [T], targets int64 [T], cu_seqlens int32)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(doc_lens)
    stream = torch.randint(0, vocab - 1, (total + 1,), generator=g)
    starts = torch.tensor([0] + doc_lens).cumsum(0)
    stream[starts[:-1]] = BOS
    stream[-1] = BOS  # the next document's BOS is the last target
    cu = starts.to(torch.int32)
    return stream[:-1].to(torch.int32), stream[1:].to(torch.int64), cu


def needs_fp8_gpu() -> None:
    """Skip the calling GPU test on a card without FP8 tensor cores (an FP8 GEMM needs compute capability
    8.9+)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability 8.9+)")


@pytest.fixture(scope="module")
def tiny_fp32() -> GPT:
    """The tiny preset computing in fp32 (bf16/fp32 storage as always), seeded."""
    torch.manual_seed(1234)
    return GPT(load_config("tiny", compute_dtype="float32"))
