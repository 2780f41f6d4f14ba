"""Greedy token ids equal HF transformers' `generate` (fp32) on the embedded model, alone and batched."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.engine_helpers import PROMPTS, make_llm, single_thread

MAX_TOKENS = 16
GREEDY_PROMPTS = PROMPTS[:8]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def hf_reference(smollm2_fp32, hf_smollm2_fp32):
    tok = smollm2_fp32.tokenizer
    refs = []
    for prompt in GREEDY_PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            out = hf_smollm2_fp32.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        refs.append((ids, out[0, len(ids) :].tolist()))
    return refs


@pytest.fixture(scope="module")
def llm(smollm2_fp32):
    return make_llm(smollm2_fp32, max_num_batched_tokens=256)


@pytest.fixture(autouse=True)
def _integrity(llm):
    yield
    llm.engine.check_integrity()


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_greedy_alone_matches_hf(llm, hf_reference):
    for ids, want in hf_reference:
        (out,) = llm.generate(ids, PARAMS, use_tqdm=False)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == want, f"prompt {ids[:8]}..."
        assert out.outputs[0].finish_reason == "length"


def test_greedy_batched_mixed_lengths_matches_hf(llm, hf_reference):
    # 256-token budget with 8 prompts: prefills are chunked and mixed with other sequences' decodes.
    outs = llm.generate([ids for ids, _ in hf_reference], PARAMS, use_tqdm=False)
    for out, (_, want) in zip(outs, hf_reference, strict=True):
        assert out.outputs[0].token_ids == want
    assert len({len(ids) for ids, _ in hf_reference}) > 4  # really mixed lengths


def test_text_prompts_and_detokenized_text(llm, smollm2_fp32, hf_reference):
    outs = llm.generate(PROMPTS[:3], PARAMS, use_tqdm=False)
    for out, (ids, want) in zip(outs, hf_reference[:3], strict=True):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].text == smollm2_fp32.tokenizer.decode(want)
