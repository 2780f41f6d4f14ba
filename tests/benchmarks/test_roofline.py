"""benchmarks.roofline's prefill fraction: each timed step against the matmul rate of its own seconds, the median
step by that fraction (not by its time or its rate alone), and the layer matmuls it is held against."""

from __future__ import annotations

import pytest
import torch

from benchmarks.prefix_floor import LayerMatmuls, linear_shapes
from benchmarks.roofline import median_pair
from tests.benchmarks.test_prefix_floor import MC  # a tiny Llama: its matmuls take milliseconds


def test_the_median_step_is_the_median_fraction_of_its_own_rate() -> None:
    flops = 10**12
    fast_host_slow_step = (1.0, 4e12)  # 25% of the rate around it
    slow_host_slow_step = (2.0, 1e12)  # 50%
    fast_step = (1.0, 1e12)  # 100%
    pairs = [fast_step, fast_host_slow_step, slow_host_slow_step]
    # By time alone the median step is 1.0 s, by rate 1e12: neither says how near its own seconds' limit it ran.
    assert median_pair(pairs, flops) == slow_host_slow_step
    assert median_pair([fast_step, slow_host_slow_step], flops) == fast_step  # the upper median of two
    with pytest.raises(AssertionError, match="no step was timed"):
        median_pair([], flops)


def test_layer_matmuls_count_every_shape_of_every_layer_at_the_rows_given() -> None:
    rows, layers = 8, 3
    matmuls = LayerMatmuls(MC, rows, torch.float32, layers=layers)
    assert matmuls.flops == layers * sum(2 * rows * n * k for n, k in linear_shapes(MC))
    assert len(matmuls.weights) == layers
    assert all([tuple(w.shape) for w in layer] == linear_shapes(MC) for layer in matmuls.weights)
    assert not torch.equal(matmuls.weights[0][0], matmuls.weights[1][0]), "distinct weights, not one reused"
    assert [tuple(x.shape) for x in matmuls.inputs] == [(rows, k) for _, k in linear_shapes(MC)]
    assert matmuls.gflops(2) > 0
