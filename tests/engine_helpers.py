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


FP32_UNIT_ROUNDOFF = 2.0**-24


def fp32_logprob_tol(loaded) -> float:
    """How far an fp32 logprob of `loaded` may move when its logits' dot products are summed in another order (another
    matmul kernel, another row count): a dot product of length K rounds by at most K * u * sum|x_i w_i| (u = 2^-24,
    the standard bound), and sum|x_i w_i| <= |x| |w| where x, the RMS-normed final state, has |x| <= max|g| sqrt(K)
    (g the norm's weight) and |w| is at most the longest lm_head row. A logprob is a logit less the log-sum-exp of
    all logits: twice that."""
    params = dict(loaded.model.named_parameters())
    head = params.get("lm_head.weight", params.get("embed_tokens"))  # tied to the embedding in SmolLM2
    norm = params["norm.weight"]
    k = head.shape[1]
    magnitude = float(norm.abs().max()) * k**0.5 * float(head.norm(dim=1).max())
    return 2 * k * FP32_UNIT_ROUNDOFF * magnitude


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
