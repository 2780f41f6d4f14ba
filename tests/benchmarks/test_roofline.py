"""benchmarks.roofline's prefill fraction: each timed step against the matmul rate of its own seconds, the median
step by that fraction (not by its time or its rate alone), and the layer matmuls it is held against."""

from __future__ import annotations

import pytest
import torch

from benchmarks.prefix_floor import LayerMatmuls, linear_shapes
from benchmarks.roofline import median_pair
from engine.model_config import ModelConfig

MC = ModelConfig.from_hf_dict(
    {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
)


def test_the_median_step_is_the_median_fraction_of_its_own_rate() -> None:
    flops = 10**12
    fast_host_slow_step = (1.0, 4e12)  # 25% of the rate around it
    slow_host_slow_step = (2.0, 1e12)  # 50%
    fast_step = (1.0, 1e12)  # 100%
    pairs = [fast_step, fast_host_slow_step, slow_host_slow_step]
    # By time alone the median step is 1.0 s, by rate 1e12: neither says how near its own seconds' limit it ran.
    assert median_pair(pairs, flops) == slow_host_slow_step
    assert median_pair([fast_step, slow_host_slow_step], flops) == fast_step  # the upper median of two
    with pytest.raises(AssertionError, match="no prefill step"):
        median_pair([], flops)


def test_layer_matmuls_count_every_shape_of_a_layer_at_the_rows_given() -> None:
    rows = 8
    layer = LayerMatmuls(MC, rows, torch.float32)
    assert layer.flops == sum(2 * rows * n * k for n, k in linear_shapes(MC))
    assert [tuple(w.shape) for _, w in layer.pairs] == linear_shapes(MC)
    assert all(x.shape == (rows, w.shape[1]) for x, w in layer.pairs)
    assert layer.gflops(2) > 0
