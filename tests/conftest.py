"""Shared fixtures. Session-scoped so the embedded model is loaded once per test run.

smollm2_fp32     engine.loader.LoadedModel of the embedded SmolLM2-135M in float32 on CPU
hf_smollm2_fp32  transformers' LlamaForCausalLM loaded from the very same converted folder, float32, eval()
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_fp32():
    import torch

    from engine.loader import load_model

    return load_model("smollm2-135m", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def hf_smollm2_fp32(smollm2_fp32):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_fp32.path), dtype=torch.float32).eval()
