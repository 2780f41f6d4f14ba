"""The routes that describe the deployment: /v1/models (and /v1/models/{id}, vLLM's model card with `root`
and `max_model_len`), /version, /health, /metrics."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from router.context import RouterContext
from router.dispatcher import DECODE_ROLES
from router.openai_schema import ApiError
from router.store_health import store_health


def info_routes(ctx: RouterContext) -> APIRouter:
    api = APIRouter()
    registry = ctx.registry

    def card() -> dict[str, Any]:
        return {
            "id": ctx.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "ucm-serve",
            # vLLM's `root` is the model's path: `vllm bench serve` without --model loads its tokenizer from it
            "root": str(getattr(ctx.tokenizer, "path", ctx.config.model)),
            "parent": None,
            "max_model_len": ctx.max_model_len(),
        }

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != ctx.config.model_name:
            raise ApiError(
                404, f"The model `{model_id}` does not exist.", "invalid_request_error", "model", "model_not_found"
            )
        return card()

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @api.get("/health")
    async def health() -> JSONResponse:
        nodes = {
            n.node_id: {
                "role": n.role.value,
                "capacity": n.info.capacity,
                "running": n.running,
                "waiting": n.waiting,
                "load": n.load,
            }
            for n in registry.nodes.values()
        }
        ok = bool(registry.alive(*DECODE_ROLES))
        # A dead store degrades hit rates, not answers: it shows here but does not make the router unhealthy.
        return JSONResponse(
            {
                "status": "ok" if ok else "no_decode_node",
                "nodes": nodes,
                "store": store_health(registry.nodes.values()),
            },
            status_code=200 if ok else 503,
        )

    @api.get("/metrics")
    async def prom() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    return api


def package_version() -> str:
    try:
        return importlib.metadata.version("ucm-serve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
