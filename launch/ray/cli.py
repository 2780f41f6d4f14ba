"""`ucm-serve up --ray`, `ucm-serve scale`, `ucm-serve status` and `ucm-serve down` (docs/deploy.md).

    ucm-serve up --ray [ADDRESS] [up's flags]      deploy; prints where each actor runs; Ctrl-C stops it
    ucm-serve scale --prefill +1 --decode -1       add nodes / drain and remove nodes of a running deployment
    ucm-serve status [--json]                      actors, hosts, load, the store's tiers
    ucm-serve down                                 stop a deployment (one started with --detach)

scale/status/down join the Ray cluster at `--ray` (default auto: the one this machine belongs to) and find the
deployment's controller by `--name`. Ray is imported here only when one of these runs.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from launch.ray.options import LOCAL, spec_from_args
from launch.ray.spec import DEFAULT_NAME, NodeKind

_MISSING_RAY = "Ray is an optional extra: pip install 'ucm-serve[ray]'"


def _have_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        print(f"ucm-serve: {_MISSING_RAY}", file=sys.stderr)
        return False
    return True


def _why(e: BaseException) -> BaseException:
    """The controller's own exception, without Ray's remote traceback around it."""
    return getattr(e, "cause", None) or e


def up_main(args: argparse.Namespace) -> int:
    """`ucm-serve up --ray`: `args` parsed by launch/launcher.py (up's own flags plus options.add_ray_args)."""
    try:
        spec = spec_from_args(args)
    except ValueError as e:
        print(f"[up] {e}", flush=True)
        return 2
    if not _have_ray():
        return 2
    from launch.ray.deploy import connect, deploy
    from launch.ray.status import format_status

    connect(None if args.ray == LOCAL else args.ray)
    print(
        f"[up] deploying {spec.name!r} on Ray: {spec.prefill} prefill, {spec.decode} decode, {spec.colocated} "
        f"colocated node(s), store {'on' if spec.store else 'off'}",
        flush=True,
    )
    try:
        # Ctrl-C meanwhile raises KeyboardInterrupt: deploy() stops whatever it started.
        deployment = deploy(spec, args.timeout)
    except (RuntimeError, ValueError) as e:
        print(f"[up] failed: {_why(e)}", flush=True)
        return 1
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    status = deployment.status()
    print(format_status(status), flush=True)
    print(f"\nucm-serve is up on Ray: {status.url}  (OpenAI API at {status.url}/v1, metrics at {status.url}/metrics)")
    if spec.detached:
        print(f"detached: `ucm-serve status --name {spec.name}`, `ucm-serve down --name {spec.name}`", flush=True)
        return 0
    print("Ctrl-C stops everything (`ucm-serve scale` / `status` from another shell meanwhile).\n", flush=True)
    try:
        while not done.wait(2.0):
            if not deployment.alive():
                print("[up] the deployment was stopped (`ucm-serve down`)", flush=True)
                return 0
        print("[up] shutting down", flush=True)
    finally:
        if deployment.alive():
            deployment.shutdown()
    return 0


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"ucm-serve {prog}", description=description)
    p.add_argument("--ray", default="auto", metavar="ADDRESS", help="the Ray cluster (default: auto)")
    p.add_argument("--name", default=DEFAULT_NAME, help="the deployment's name")
    return p


def _find(args: argparse.Namespace):
    from launch.ray.deploy import connect, find

    connect(args.ray, log_to_driver=False)
    return find(args.name)


def scale_main(argv: list[str]) -> int:
    p = _parser("scale", "Add nodes to a Ray deployment, or drain and remove some (they finish their requests first).")
    for kind in NodeKind:
        p.add_argument(f"--{kind.value}", type=int, default=0, metavar="±N", help=f"{kind.value} nodes to add/remove")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for new nodes / for a drain")
    args = p.parse_args(argv)
    deltas = {kind: getattr(args, kind.value) for kind in NodeKind if getattr(args, kind.value)}
    if not deltas:
        p.error("nothing to do: give --prefill, --decode or --colocated with +N or -N")
    if not _have_ray():
        return 2
    try:
        deployment = _find(args)
        # Additions first: a swap (--decode +1 with --prefill -1...) never leaves fewer nodes than it ends with.
        for kind, delta in sorted(deltas.items(), key=lambda kv: kv[1] < 0):
            names = deployment.scale(kind, delta, args.timeout)
            print(f"{'added' if delta > 0 else 'drained and removed'}: {', '.join(names)}", flush=True)
    except (ValueError, RuntimeError) as e:
        print(f"ucm-serve scale: {_why(e)}", file=sys.stderr)
        return 1
    return 0


def status_main(argv: list[str]) -> int:
    p = _parser("status", "Where each actor of a Ray deployment runs, its load, and the store's tiers.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if not _have_ray():
        return 2
    from launch.ray.status import format_status

    try:
        status = _find(args).status()
    except ValueError as e:
        print(f"ucm-serve status: {e}", file=sys.stderr)
        return 1
    if args.json:
        import msgspec

        print(msgspec.json.encode(status).decode(), flush=True)
    else:
        print(format_status(status), flush=True)
    return 0


def down_main(argv: list[str]) -> int:
    args = _parser("down", "Stop a Ray deployment: nodes, router, store, controller.").parse_args(argv)
    if not _have_ray():
        return 2
    try:
        _find(args).shutdown()
    except ValueError as e:
        print(f"ucm-serve down: {e}", file=sys.stderr)
        return 1
    print(f"deployment {args.name!r} stopped", flush=True)
    return 0
