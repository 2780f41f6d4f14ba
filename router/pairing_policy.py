"""`PairingPolicy`: the rules router/pairing.py can pick each request's prefill and decode node by."""

from __future__ import annotations

import enum


class PairingPolicy(enum.Enum):
    # least expected seconds: tokens to compute x measured token cost + queue ahead; decode likewise
    COST = "cost"
    # the longest cached prefix within a load slack, else the least loaded (the policy before COST)
    PREFIX_SLACK = "prefix-slack"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"
    DYNAMO = "dynamo"  # NVIDIA Dynamo's KV router: least overlap_weight x prefill blocks + decode blocks
    SGLANG = "sglang"  # SGLang's router: shortest queue when imbalanced, else the best prefix match over a threshold
