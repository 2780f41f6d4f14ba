"""Turns logits into tokens: penalties, logit bias, min_tokens, the guided-decoding grammar mask, temperature, min-p, top-k, top-p, then greedy or seeded
sampling, vectorised across the batch; optional logprobs of the raw distribution (like vLLM's default).

Randomness: the sample for output position t of sample i of a request is an inverse-CDF draw from `probs` with
the uniform u = mix(seed, i, t) / 2^63, so it is the same alone or in any batch, and after recompute-preemption:
the first token whose running probability sum exceeds u times the row's total. One number and one pass over the
probabilities a row: exponential noise over the whole vocabulary from a seeded generator per row (the earlier draw)
took 6.1 ms a decode step of 8 rows against 0.2 ms for this (49152 tokens, AMD EPYC AVX-512, 2 threads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.guided.backend import GuidedBackend
from engine.sampling_params import SamplingParams
from engine.scheduler_output import TokenLogprobs

_MASK64 = (1 << 63) - 1


INVERSE_CDF_BLOCK = 256  # tokens per block of the two-level search


def inverse_cdf_draw(probs: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """One token a row of `probs` (unnormalised, >= 0, some > 0), drawn with the uniform u = top 53 bits of seeds[j].

    Two levels, in fp64: the row's blocks of INVERSE_CDF_BLOCK tokens are summed and the block whose running sum
    first passes u * total is found, then the token inside that block whose running sum first passes the rest.
    A full-vocabulary running sum in fp64 (one 12.6 MB buffer a step of 32 rows) took 3-5 ms a step; this reads
    probs once and makes only small tensors. Each target stays below its total, so the first sum above it ends a
    block or token of positive probability (probability 0 adds nothing: `right=True` never lands on it).
    """
    assert probs.dim() == 2 and probs.shape[0] == len(seeds), f"{tuple(probs.shape)} rows vs {len(seeds)} seeds"
    rows, vocab = probs.shape
    padded = probs if vocab % INVERSE_CDF_BLOCK == 0 else F.pad(probs, (0, -vocab % INVERSE_CDF_BLOCK))
    blocks = padded.reshape(rows, -1, INVERSE_CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    u = torch.tensor([(seed & _MASK64) >> 10 for seed in seeds], dtype=torch.float64) * 2.0**-53  # in [0, 1)
    target = _below(u * block_cdf[:, -1], block_cdf[:, -1])
    b = torch.searchsorted(block_cdf, target.unsqueeze(1), right=True).squeeze(1)
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    local = blocks[torch.arange(rows), b].to(torch.float64).cumsum(dim=-1)
    rest = _below(target - before, local[:, -1])
    return b * INVERSE_CDF_BLOCK + torch.searchsorted(local, rest.unsqueeze(1), right=True).squeeze(1)


def _below(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """x capped to the largest float under total (a rounding can put u * total, or a block's rest, on or past it)."""
    return torch.minimum(x, torch.nextafter(total, torch.zeros_like(total)))


def mix_seed(seed: int, sample_index: int, position: int) -> int:
    """A 63-bit generator seed for one draw (splitmix64-style mixing, so nearby inputs give unrelated seeds)."""
    x = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & (
        (1 << 64) - 1
    )
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    return x & _MASK64


@dataclass
class SamplingRow:
    """One row of logits to sample from (a row may be sampled several times when a request forks)."""

    params: SamplingParams
    seed: int
    sample_index: int
    position: int  # index of the output token being sampled
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]

    @property
    def generated_token_ids(self) -> list[int]:
        """Everything this request generated: earlier output carried in the prompt, then this engine's."""
        k = self.params.prior_output_tokens
        return (
            self.prompt_token_ids[len(self.prompt_token_ids) - k :] + self.output_token_ids
            if k
            else self.output_token_ids
        )


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of tied maxima; a NaN counts as the maximum), as torch.argmax gives it, through
    torch.max's indices: 90 against 250 us for 8 rows of 49152 fp32 logits on the 2-core Xeon with AMX (torch 2.13;
    a decode step of Qwen2.5-0.5B's shape takes ~36 ms)."""
    return logits.max(dim=-1).indices


class Sampler:
    def __init__(self, guided: GuidedBackend | None = None) -> None:
        # Set by the engine (it owns the tokenizer the grammars are compiled against); None: guided rows fail.
        self.guided = guided

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), f"{tuple(logits.shape)} logits for {len(rows)} rows"
        logits = logits.float()
        num_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = None
        if any(k is not None for k in num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, rows)
        logits = self._apply_logit_bias(logits, rows)
        logits = self._apply_allowed(logits, rows)
        logits = self._apply_min_tokens(logits, rows)
        logits = self._apply_guided(logits, rows)
        tokens = self._sample(logits, rows)
        out_logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            out_logprobs = self._gather_logprobs(raw_logprobs, tokens, num_logprobs)
        return tokens.tolist(), out_logprobs

    # -- logit processors -----------------------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        if not idx:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in idx:
            p = rows[i].params
            out_ids = torch.tensor(rows[i].generated_token_ids, dtype=torch.long)
            counts = torch.bincount(out_ids[out_ids < vocab], minlength=vocab).to(logits.dtype)
            row = logits[i]
            if p.repetition_penalty != 1.0:
                # Like vLLM/HF: every token seen in prompt or output is pushed away from being chosen.
                seen = counts > 0
                prompt_ids = torch.tensor(rows[i].prompt_token_ids, dtype=torch.long)
                seen[prompt_ids[prompt_ids < vocab]] = True
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row = torch.where(seen, penalised, row)
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
            logits[i] = row
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        idx = [i for i, r in enumerate(rows) if r.params.logit_bias]
        if not idx:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in idx:
            bias = rows[i].params.logit_bias or {}
            ids = [t for t in bias if t < vocab]  # ids beyond this model's vocabulary name no logit
            if ids:
                logits[i, ids] += torch.tensor([bias[t] for t in ids], dtype=logits.dtype)
        return logits

    @staticmethod
    def _apply_allowed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        idx = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
        if not idx:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in idx:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[[t for t in rows[i].params.allowed_token_ids or () if t < vocab]] = True
            logits[i] = logits[i].masked_fill(~keep, float("-inf"))
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # A guided row is left to its grammar: once complete, only the end of sequence may follow.
        blocked = [
            (i, sorted(r.params.stop_token_ids + tuple(() if r.params.ignore_eos else r.eos_token_ids)))
            for i, r in enumerate(rows)
            if len(r.output_token_ids) < r.params.min_tokens and r.params.guided_decoding is None
        ]
        if not blocked:
            return logits
        logits = logits.clone()
        for i, ids in blocked:
            if ids:
                logits[i, ids] = float("-inf")
        return logits

    def _apply_guided(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        guided = [
            (i, r.params.guided_decoding, r.output_token_ids, r.sample_index, r.generated_token_ids)
            for i, r in enumerate(rows)
            if r.params.guided_decoding is not None
        ]
        if not guided:
            return logits
        assert self.guided is not None, "a request asks for guided decoding but the sampler has no GuidedBackend"
        logits = logits.clone()
        self.guided.apply(logits, guided)
        return logits

    # -- sampling -----------------------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        rand = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not rand:
            return greedy(logits)
        # All rows drawn (vllm bench serve's temperature 1): no argmax and no row copy; each took 60-120 us a step
        # of 8 over SmolLM2's 49152 tokens.
        every = len(rand) == len(rows)
        tokens = torch.empty(len(rows), dtype=torch.long) if every else greedy(logits)
        sub = logits if every else logits[rand]
        temps = torch.tensor([rows[i].params.temperature for i in rand], dtype=sub.dtype).unsqueeze(1)
        probs = torch.softmax(sub / temps, dim=-1)
        min_p = torch.tensor([rows[i].params.min_p for i in rand], dtype=sub.dtype).unsqueeze(1)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        top_k = [rows[i].params.top_k for i in rand]
        top_p = [rows[i].params.top_p for i in rand]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            probs = self._top_k_top_p(probs, top_k, top_p)
        tokens[rand] = inverse_cdf_draw(
            probs, [mix_seed(rows[i].seed, rows[i].sample_index, rows[i].position) for i in rand]
        )
        return tokens

    @staticmethod
    def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        vocab = probs.shape[1]
        # Clamped so any top_k (however large) is a small tensor value: beyond the vocabulary it keeps every token.
        ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k]).unsqueeze(1)
        ranks = torch.arange(vocab).unsqueeze(0)
        keep = ranks < ks
        sorted_probs = sorted_probs * keep
        ps = torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays, like vLLM).
        cum = sorted_probs.cumsum(dim=-1) / sorted_probs.sum(dim=-1, keepdim=True)
        keep_p = (cum - sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)) < ps
        keep_p[:, 0] = True
        sorted_probs = sorted_probs * keep_p
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs)

    @staticmethod
    def _gather_logprobs(
        logprobs: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]
    ) -> list[TokenLogprobs | None]:
        k_max = min(max(k for k in num_logprobs if k is not None), logprobs.shape[1])
        top_vals, top_ids = logprobs.topk(k_max, dim=-1) if k_max > 0 else (None, None)
        sampled_lp = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        # Rank = 1 + number of tokens strictly more likely than the sampled one.
        ranks = (logprobs > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1
        out: list[TokenLogprobs | None] = []
        for i, k in enumerate(num_logprobs):
            if k is None:
                out.append(None)
                continue
            ids = top_ids[i, :k].tolist() if top_ids is not None and k > 0 else []
            vals = top_vals[i, :k].tolist() if top_vals is not None and k > 0 else []
            tok = int(tokens[i])
            entry = TokenLogprobs([tok], [float(sampled_lp[i])], [int(ranks[i])])
            for rank, (tid, val) in enumerate(zip(ids, vals), start=1):
                if tid != tok:
                    entry.token_ids.append(tid)
                    entry.logprobs.append(val)
                    entry.ranks.append(rank)
            out.append(entry)
        return out
