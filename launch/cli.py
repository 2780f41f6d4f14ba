"""`ucm-serve` entry point: dispatches a subcommand to the package that owns it.

Each subcommand module parses its own arguments (one argparse per entry point) and is imported only
when chosen, so `ucm-serve router` never imports torch and `ucm-serve store` never loads a model.
"""

from __future__ import annotations

import importlib
import os
import sys

from node.openmp_env import node_openmp_env

# subcommand -> (module, function taking argv, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("engine.generate_cli", "main", "generate text offline on one engine, streaming to stdout"),
    "store": ("ucm.daemon_cli", "main", "run the standalone KV-store daemon"),
    "store-stats": ("ucm.daemon_cli", "stats_main", "print a running store daemon's live stats"),
    "keys": ("ucm.daemon_cli", "keys_main", "write CURVE keys for the router, the store and each node (one folder)"),
    "prefill": ("prefill_node.cli", "main", "run a prefill node (KV producer)"),
    "decode": ("decode_node.cli", "main", "run a decode node (KV consumer)"),
    "router": ("launch.model_prep", "router_main", "run the OpenAI-compatible HTTP router"),
    "up": ("launch.launcher", "main", "start store, prefill and decode nodes and the router on this machine"),
    "scale": ("launch.ray.cli", "scale_main", "add nodes to, or drain nodes from, a Ray deployment (up --ray)"),
    "status": ("launch.ray.cli", "status_main", "a Ray deployment: where each actor runs, its load, the store's tiers"),
    "down": ("launch.ray.cli", "down_main", "stop a Ray deployment (one started with up --ray --detach)"),
    "serve": ("launch.launcher", "serve_main", "`serve MODEL`: the same as `up --model MODEL` (vLLM's one-line form)"),
    "env": ("launch.env_report", "main", "the host, versions, lock and every calibrated kernel choice (--pin FILE)"),
}
# The serving nodes: their OpenMP wait policy is set before their module imports torch (node/openmp_env.py).
NODE_COMMANDS = ("prefill", "decode")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ucm-serve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


def _usage() -> str:
    lines = ["usage: ucm-serve <command> [options]   |   ucm-serve --version", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"ucm-serve {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"ucm-serve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = SUBCOMMANDS[name]
    if name in NODE_COMMANDS:
        node_openmp_env(os.environ)
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
