"""The last layer past its attention runs on the rows a step samples only (engine/models/llama.py `keep`): every row
still writes its k and v, the tokens are those of a forward that computes every row, and a step that samples nothing
(a prompt's first chunk) runs no MLP in the last layer at all."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_llm


def _mlp_rows(model) -> tuple[list[int], list[int]]:
    """Rows per call of the first and of the last layer's MLP, recorded as the model runs."""
    first, last = [], []
    for layer, calls in ((model.layers[0], first), (model.layers[-1], last)):
        forward = layer.mlp.forward

        def spy(x, rows=None, _forward=forward, _calls=calls):
            _calls.append(x.shape[0])
            return _forward(x, rows)

        layer.mlp.forward = spy
    return first, last


def test_the_last_layer_computes_the_sampled_rows_only_and_the_tokens_do_not_change(smollm2_fp32) -> None:
    tok_a = list(range(1000, 1040))
    tok_b = list(range(2000, 2025))
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    llm = make_llm(smollm2_fp32, enable_prefix_caching=False)
    model = llm.engine.runner.model
    try:
        first, last = _mlp_rows(model)
        pruned = llm.generate([{"prompt_token_ids": tok_a}, {"prompt_token_ids": tok_b}], params, use_tqdm=False)
        assert first[0] == 65 and last[0] == 2, (first, last)  # the prompt step: both prompts, two sampled rows
        assert len(first) == len(last) and all(f == n for f, n in zip(first[1:], last[1:], strict=True)), (
            "a decode step samples every row it computes"
        )
        forward = model.forward

        def every_row(input_ids, positions, kv_caches, keep=None):
            hidden = forward(input_ids, positions, kv_caches, None)
            return hidden if keep is None else hidden.index_select(0, keep)

        model.forward = every_row
        first.clear(), last.clear()
        full = llm.generate([{"prompt_token_ids": tok_a}, {"prompt_token_ids": tok_b}], params, use_tqdm=False)
        assert last[0] == 65, last
    finally:
        model.__dict__.pop("forward", None)
        for layer in model.layers:
            layer.mlp.__dict__.pop("forward", None)
        llm.close()
    for p, f in zip(pruned, full, strict=True):
        assert p.outputs[0].token_ids == f.outputs[0].token_ids
        for lp, lf in zip(p.outputs[0].logprobs, f.outputs[0].logprobs, strict=True):
            assert lp.keys() == lf.keys()
            torch.testing.assert_close(
                [x.logprob for x in lp.values()], [x.logprob for x in lf.values()], atol=1e-4, rtol=0
            )


def test_a_chunk_that_samples_nothing_runs_no_mlp_in_the_last_layer(smollm2_fp32) -> None:
    llm = make_llm(smollm2_fp32, enable_prefix_caching=False, max_num_batched_tokens=32)
    model = llm.engine.runner.model
    try:
        first, last = _mlp_rows(model)
        out = llm.generate({"prompt_token_ids": list(range(500, 570))}, SamplingParams(max_tokens=2, temperature=0))
    finally:
        for layer in model.layers:
            layer.mlp.__dict__.pop("forward", None)
        llm.close()
    # 70 prompt tokens in chunks of 32 (a decode step may take the native decode path, which calls no layer module)
    assert first[:3] == [32, 32, 6], first
    assert last == [1] * (len(first) - 2), ("the two chunks that sample nothing skip it; then one row a step", last)
    assert len(out[0].outputs[0].token_ids) == 2
