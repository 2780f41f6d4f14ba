"""`ucm-serve decode`: a KV consumer node (loads prompts' KV from the store, decodes, streams tokens).

With `--colocated` it is one engine doing prefill and decode itself (saving and loading through the store when
one is given): the router then sends it every request. The runtime is shared with prefill nodes: node/."""

from __future__ import annotations

import argparse
import logging

from decode_node.worker import DecodeWorker
from node.config import add_node_args, config_from_args
from node.server import run_node


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm-serve decode", description=__doc__)
    add_node_args(parser)
    parser.add_argument("--colocated", action="store_true", help="prefill and decode in this one engine")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        worker = DecodeWorker(colocated=args.colocated)
        config = config_from_args(args, worker.role)
    except ValueError as e:
        parser.error(str(e))
    return run_node(config, worker)
