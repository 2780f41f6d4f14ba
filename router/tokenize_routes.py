"""vLLM's tokenizer endpoints: POST /tokenize (`{"model", "prompt"}` or `{"model", "messages"}` →
`{"count", "max_model_len", "tokens"}`) and POST /detokenize (`{"model", "tokens"}` → `{"prompt"}`), with
vLLM's request fields (vllm/entrypoints/serve/tokenize/protocol.py). Like vLLM's, they sit outside /v1 (no API
key). Bodies are size-capped and parsed, and tokenizing runs, on the parse thread, as for completions."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.context import RouterContext
from router.errors import validation_error
from router.json_body import parse_json_object
from router.openai_schema import ApiError, ChatMessage, bad_request
from router.routes import parse

_STRICT = ConfigDict(extra="forbid")


class TokenizeCompletionRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # accepted like vLLM's; the chat template places the special tokens
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def _validate_tokenize(raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """Either shape, told apart by `messages` as vLLM does; ApiError(400) otherwise."""
    obj = parse_json_object(raw)
    model = TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None


def check_model(ctx: RouterContext, model: str | None) -> None:
    if model is not None and model != ctx.config.model_name:
        raise ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


def _tokenize(ctx: RouterContext, body: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
    tok = ctx.tokenizer
    if isinstance(body, TokenizeChatRequest):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return list(tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt))
        except Exception as e:  # a template error is the client's messages' fault
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from e
    return list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))


def _prompt_chars(body: TokenizeCompletionRequest | TokenizeChatRequest) -> int:
    if isinstance(body, TokenizeChatRequest):
        return sum(len(m.text()) for m in body.messages)
    return len(body.prompt)


def tokenize_routes(ctx: RouterContext) -> APIRouter:
    api = APIRouter()

    async def on_parse_thread(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(ctx.pool, fn, *args)

    @api.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        raw = await request.body()  # at most config.max_body_bytes: HttpGate answered 413 beyond
        body = await on_parse_thread(_validate_tokenize, raw)
        check_model(ctx, body.model)
        if _prompt_chars(body) > ctx.config.max_prompt_chars:
            raise bad_request(
                f"the prompt has {_prompt_chars(body)} characters; the limit is {ctx.config.max_prompt_chars}",
                "messages" if isinstance(body, TokenizeChatRequest) else "prompt",
            )
        ids = await on_parse_thread(_tokenize, ctx, body)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len(), "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
        return out

    @api.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        body: DetokenizeRequest = await parse(ctx, request, DetokenizeRequest)
        check_model(ctx, body.model)
        vocab = ctx.tokenizer.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": await on_parse_thread(ctx.tokenizer.decode, body.tokens)}

    return api
