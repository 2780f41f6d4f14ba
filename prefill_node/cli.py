"""`ucm-serve prefill`: a KV producer node (computes prompts' KV, saves it to the store, returns the first token).

The runtime is shared with decode nodes: node/."""

from __future__ import annotations

import argparse
import logging

from node.config import add_node_args, config_from_args
from node.server import run_node
from prefill_node.worker import PrefillWorker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm-serve prefill", description=__doc__)
    add_node_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        worker = PrefillWorker()
        config = config_from_args(args, worker.role)
    except ValueError as e:
        parser.error(str(e))
    return run_node(config, worker)
