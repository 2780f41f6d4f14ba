"""Issue 15's engine side: logit_bias, min_tokens, and `prior_output_tokens` (a decode node continuing after a
prefill node's first token samples exactly as one unbroken engine would). Synthetic logits for the sampler,
the embedded SmolLM2 (greedy, fp32) for the end-to-end equalities."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.sampler import Sampler, SamplingRow
from tests.engine_helpers import make_llm, single_thread

V = 50
EOS = 0


def row(params: SamplingParams, output=(), prompt=(1, 2)) -> SamplingRow:
    return SamplingRow(params, 0, 0, len(output), list(prompt), list(output), frozenset([EOS]))


def logits(n: int = 1) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(0)) * 3


def test_logit_bias_forces_and_bans_tokens() -> None:
    x = logits()
    top = int(x[0].argmax())
    (forced,), _ = Sampler()(x, [row(SamplingParams(temperature=0, logit_bias={7: 100.0}))])
    (banned,), _ = Sampler()(x, [row(SamplingParams(temperature=0, logit_bias={top: -100.0}))])
    assert forced == 7 and banned != top
    (far,), _ = Sampler()(x, [row(SamplingParams(temperature=0, logit_bias={V + 5: 100.0}))])
    assert far == top  # an id beyond this vocabulary biases nothing


def test_allowed_token_ids_restrict_sampling() -> None:
    x = logits()
    allowed = (3, 9, 41)
    (greedy,), _ = Sampler()(x, [row(SamplingParams(temperature=0, allowed_token_ids=list(allowed)))])
    assert greedy == max(allowed, key=lambda t: float(x[0, t]))
    for seed in range(20):
        params = SamplingParams(temperature=1.5, allowed_token_ids=allowed)
        (tok,), _ = Sampler()(x, [SamplingRow(params, seed, 0, 0, [1], [], frozenset([EOS]))])
        assert tok in allowed
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_logit_bias_keys_as_strings_and_bounds() -> None:
    assert SamplingParams(logit_bias={"12": 1.5}).logit_bias == {12: 1.5}  # OpenAI's JSON object keys
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


def test_penalties_count_prior_output_in_the_prompt() -> None:
    x = torch.zeros(1, V)
    x[0, 5] = 1.0
    x[0, 6] = 0.5
    plain = SamplingParams(temperature=0, presence_penalty=1.0)
    prior = SamplingParams(temperature=0, presence_penalty=1.0, prior_output_tokens=1)
    (as_prompt,), _ = Sampler()(x, [row(plain, prompt=(1, 5))])
    (as_output,), _ = Sampler()(x, [row(prior, prompt=(1, 5))])
    assert as_prompt == 5 and as_output == 6  # 5 ends the prompt but is earlier output: it is penalised


@pytest.fixture(scope="module")
def llm(smollm2_fp32):
    with single_thread():
        yield make_llm(smollm2_fp32)


def _run(llm, prompt, **params) -> list[int]:
    out = llm.generate(prompt, SamplingParams(temperature=0, **params), use_tqdm=False)[0].outputs[0]
    return out.token_ids


def test_min_tokens_delays_eos(llm) -> None:
    ids = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Say hi."}])
    free = _run(llm, {"prompt_token_ids": ids}, max_tokens=64)
    assert free[-1] in llm.engine.eos_token_ids and len(free) < 60
    held = _run(llm, {"prompt_token_ids": ids}, max_tokens=64, min_tokens=len(free) + 4)
    assert len(held) >= len(free) + 4
    assert not set(held[: len(free) + 3]) & llm.engine.eos_token_ids


@pytest.mark.parametrize(
    "params",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5}, {"repetition_penalty": 1.5}],
    ids=["presence", "frequency", "repetition"],
)
def test_continuing_after_the_first_token_equals_one_run(llm, params) -> None:
    """What a decode node does: prompt + first token, prior_output_tokens=1, the rest of max_tokens."""
    prompt = llm.get_tokenizer().encode("I like cats. I like cats. I like")
    whole = _run(llm, {"prompt_token_ids": prompt}, max_tokens=12, **params)
    rest = _run(llm, {"prompt_token_ids": prompt + whole[:1]}, max_tokens=11, prior_output_tokens=1, **params)
    assert rest == whole[1:]
    assert whole != _run(llm, {"prompt_token_ids": prompt}, max_tokens=12)  # the penalty did something


def test_chat_template_options(llm) -> None:
    tok = llm.get_tokenizer()
    convo = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hello! How"}]
    sp = SamplingParams(temperature=0, max_tokens=6)
    cont = llm.chat(convo, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    rendered = tok.render_chat(convo, False, continue_final_message=True)
    assert rendered.endswith("Hello! How") and cont.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert cont.outputs[0].text == llm.generate(rendered, sp, use_tqdm=False)[0].outputs[0].text
    custom = llm.chat(convo[:1], sp, use_tqdm=False, chat_template="Q: {{ messages[0].content }}\nA:")[0]
    assert custom.prompt_token_ids == tok.encode("Q: Say hi.\nA:", add_special_tokens=False)
