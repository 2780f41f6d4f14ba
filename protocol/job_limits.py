"""Bounds on every field of a job that crosses the router → node wire: the ONE place both sides take them from.

The router's request schema (router/openai_schema.py) uses these numbers for its 400s and checks the SamplingSpec
it builds with `check_job`; a node checks every job it receives with the same function before the engine sees it
(a job from a buggy or hostile peer gets JobFailed, never reaches a tensor). Torch-free, like protocol/messages.py.

Why each bound matters: torch turns a Python int beyond int64 into an "Overflow when unpacking long" inside the
sampler, msgpack cannot encode ints beyond 64 bits at all, `topk(k)` with k above the vocabulary raises, and a
NaN temperature poisons a whole batch's softmax.
"""

from __future__ import annotations

import math
from typing import Any

from protocol import messages as P

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

MAX_N = 16  # choices per prompt
MAX_LOGPROBS = 20  # OpenAI's own limit for top_logprobs
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.0, 2.0
# Beyond any vocabulary a top_k keeps every token; the bound only keeps the number a small int everywhere.
MAX_TOP_K = 1 << 20
MAX_TOKENS = (1 << 31) - 1  # the node's max_model_len bounds max_tokens further
MAX_TOKEN_ID = (1 << 31) - 1  # nodes also check ids against their vocabulary
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 8  # router only: stop strings never cross the wire
MAX_PROMPT_TOKENS = 1 << 20  # wire bound; max_model_len is the real limit on both sides
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256
MAX_TRANSFER_PARAMS_DEPTH = 16  # kv_transfer_params is connector-defined JSON-like data
MAX_PENALTY = 2.0  # presence / frequency penalties: OpenAI's range is [-2, 2]
MAX_REPETITION_PENALTY = 10.0  # > 0; far above any useful value
MAX_LOGIT_BIAS = 100.0  # OpenAI: a bias in [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 16
MAX_GUIDE_CHARS = 64 * 1024  # a JSON schema or regular expression (compiled on the node)


class OutOfBounds(ValueError):
    """A job field outside its bounds; `param` is the OpenAI parameter (or wire field) it came from."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def _int_in(param: str, value: Any, lo: int, hi: int) -> None:
    if type(value) is not int or not lo <= value <= hi:
        raise OutOfBounds(param, f"must be an integer in [{lo}, {hi}], got {value!r:.40}")


def _float_in(param: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        left = "(" if lo_open else "["
        raise OutOfBounds(param, f"must be a finite number in {left}{lo}, {hi}], got {value!r:.40}")


def check_spec(spec: P.SamplingSpec) -> None:
    """Raise OutOfBounds for the first field of `spec` outside its bounds."""
    _int_in("max_tokens", spec.max_tokens, 1, MAX_TOKENS)
    _float_in("temperature", spec.temperature, MIN_TEMPERATURE, MAX_TEMPERATURE)
    _float_in("top_p", spec.top_p, 0.0, 1.0, lo_open=True)
    _int_in("top_k", spec.top_k, -1, MAX_TOP_K)
    if spec.seed is not None:
        _int_in("seed", spec.seed, INT64_MIN, INT64_MAX)
    if not isinstance(spec.stop_token_ids, list) or len(spec.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise OutOfBounds("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids")
    for t in spec.stop_token_ids:
        _int_in("stop_token_ids", t, 0, MAX_TOKEN_ID)
    if type(spec.ignore_eos) is not bool:
        raise OutOfBounds("ignore_eos", "must be a boolean")
    if spec.logprobs is not None:
        _int_in("logprobs", spec.logprobs, 0, MAX_LOGPROBS)
    _float_in("min_p", spec.min_p, 0.0, 1.0)
    _float_in("repetition_penalty", spec.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, lo_open=True)
    _float_in("presence_penalty", spec.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _float_in("frequency_penalty", spec.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    _int_in("num_generated", spec.num_generated, 0, MAX_TOKENS)
    _int_in("min_tokens", spec.min_tokens, 0, spec.max_tokens + spec.num_generated)
    if not isinstance(spec.logit_bias, dict) or len(spec.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise OutOfBounds("logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens")
    for tok, bias in spec.logit_bias.items():
        _int_in("logit_bias", tok, 0, MAX_TOKEN_ID)
        _float_in("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    if not isinstance(spec.allowed_token_ids, list) or len(spec.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise OutOfBounds("allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} token ids")
    for t in spec.allowed_token_ids:
        _int_in("allowed_token_ids", t, 0, MAX_TOKEN_ID)
    guide = spec.guide
    if guide is not None:
        if not isinstance(guide, P.GuideSpec) or not isinstance(guide.kind, P.GuideKind):
            raise OutOfBounds("response_format", "not a guide")
        if (guide.schema is None) != (guide.kind is P.GuideKind.JSON_OBJECT):
            raise OutOfBounds(
                "response_format", f"a {guide.kind.value} guide {'takes no' if guide.schema else 'needs a'} schema"
            )
        if guide.schema is not None and (not isinstance(guide.schema, str) or len(guide.schema) > MAX_GUIDE_CHARS):
            raise OutOfBounds("response_format", f"the schema must be a string of at most {MAX_GUIDE_CHARS} characters")


def _depth_within(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, (list, tuple)):
            children = list(item)
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def check_job(job: P.PrefillJob | P.DecodeJob, vocab_size: int | None = None) -> None:
    """Raise OutOfBounds for the first field of a job outside its bounds; with `vocab_size`, token ids must be
    below it (a node knows its vocabulary; the wire bound alone is MAX_TOKEN_ID)."""
    if not isinstance(job.request_id, str) or not 0 < len(job.request_id) <= MAX_REQUEST_ID_CHARS:
        raise OutOfBounds("request_id", f"must be 1 to {MAX_REQUEST_ID_CHARS} characters")
    if job.cache_salt is not None and (
        not isinstance(job.cache_salt, str) or not 0 < len(job.cache_salt) <= MAX_CACHE_SALT_CHARS
    ):
        raise OutOfBounds("cache_salt", f"must be 1 to {MAX_CACHE_SALT_CHARS} characters")
    ids = job.prompt_token_ids
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_PROMPT_TOKENS:
        raise OutOfBounds("prompt", f"must hold 1 to {MAX_PROMPT_TOKENS} token ids")
    top = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
    if any(type(t) is not int or not 0 <= t <= top for t in ids):
        raise OutOfBounds("prompt", f"token ids must be integers in [0, {top}]")
    check_spec(job.params)
    if vocab_size is not None and any(t > top for t in job.params.stop_token_ids):
        raise OutOfBounds("stop_token_ids", f"token ids must be below the vocabulary size {vocab_size}")
    if vocab_size is not None and any(t > top for t in job.params.allowed_token_ids):
        raise OutOfBounds("allowed_token_ids", f"token ids must be below the vocabulary size {vocab_size}")
    if vocab_size is not None and any(t > top for t in job.params.logit_bias):
        raise OutOfBounds("logit_bias", f"token ids must be below the vocabulary size {vocab_size}")
    # Earlier output ends the prompt + first token, so only a decode job continuing one can carry any.
    most = len(ids) + 1 if isinstance(job, P.DecodeJob) and job.first_token_id is not None else 0
    if job.params.num_generated > most:
        raise OutOfBounds(
            "num_generated", f"{job.params.num_generated} generated tokens but at most {most} in this job"
        )
    if isinstance(job, P.DecodeJob):
        if job.first_token_id is not None:
            _int_in("first_token_id", job.first_token_id, 0, top)
        if job.kv_transfer_params is not None and not _depth_within(job.kv_transfer_params, MAX_TRANSFER_PARAMS_DEPTH):
            raise OutOfBounds("kv_transfer_params", f"nested deeper than {MAX_TRANSFER_PARAMS_DEPTH}")
