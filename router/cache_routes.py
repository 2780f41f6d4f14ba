"""`POST /reset_prefix_cache` (vLLM's route, `?node=<id>` for one node): every registered node (or the one named)
drops its device prefix cache once no request holds blocks there, and publishes AllBlocksCleared, which makes the
router's KV index forget it (router/kv_index.py). The store's tiers are not touched."""

from __future__ import annotations

from fastapi import APIRouter

from protocol import messages as P
from router.context import RouterContext
from router.node_client import NodeUnavailable
from router.openai_schema import ApiError


def cache_routes(ctx: RouterContext) -> APIRouter:
    api = APIRouter()

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache(node: str | None = None) -> dict[str, list[str]]:
        """The ids of the nodes asked to reset."""
        registry = ctx.registry
        if node is not None and node not in registry.nodes:
            raise ApiError(404, f"node {node!r} is not registered", "invalid_request_error", "node", "node_not_found")
        client = ctx.ready_serving().dispatcher.client
        asked: list[str] = []
        for node_id in [node] if node is not None else sorted(registry.nodes):
            try:
                await client.send(node_id, P.ResetPrefixCache())
            except NodeUnavailable:
                continue  # dropped meanwhile: its index entries went with it
            asked.append(node_id)
        return {"nodes": asked}

    return api
