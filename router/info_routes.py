"""The routes that describe the deployment: /v1/models, /health, /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from router.context import RouterContext
from router.dispatcher import DECODE_ROLES
from router.store_health import store_health


def info_routes(ctx: RouterContext) -> APIRouter:
    api = APIRouter()
    registry = ctx.registry

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": ctx.config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "ucm-serve",
                    "max_model_len": registry.max_model_len(),
                }
            ],
        }

    @api.get("/health")
    async def health() -> JSONResponse:
        nodes = {
            n.node_id: {"role": n.role.value, "running": n.running, "waiting": n.waiting, "load": n.load}
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
