"""Helpers shared by the engine-core test modules (not a conftest: the model fixtures live there)."""

from __future__ import annotations

import contextlib

import torch

from engine import LLM


@contextlib.contextmanager
def single_thread():
    """The CI box has 2 shared cores: OpenMP spin-waiting across busy cores makes small matmuls ~40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_llm(loaded, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "32MiB")
    kwargs.setdefault("max_num_batched_tokens", 512)
    return LLM(dtype="float32", loaded_model=loaded, **kwargs)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Translate to German: Good morning, how are you?",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Q: What is the boiling point of water at sea level?\nA:",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "In 1969, the first humans landed on the",
    "Photosynthesis is the process by which plants convert sunlight into chemical energy. The main steps are",
]
