"""`ucm-serve router`: the OpenAI-compatible HTTP front end. Torch-free (a test checks sys.modules)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from common.auth import KeyPaths, ServerAuth
from protocol import defaults, flags
from protocol import messages as P
from router.config import PrefixSource, RouterConfig
from router.pairing_policy import PairingPolicy

log = logging.getLogger("router")


def model_folder(model: str | None) -> Path:
    """The router takes a ready model folder (for its tokenizer): resolving an alias or converting a .gguf needs
    torch, which the router never loads. `ucm-serve router`, `up` and `serve` resolve a spec before starting it."""
    if not model:
        raise ValueError("the router needs --model FOLDER (a model folder with a tokenizer.json)")
    path = Path(model).expanduser()
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"--model {model!r} is not a model folder with a tokenizer.json (`ucm-serve router`, `up` and `serve` "
            "turn an alias or a .gguf into one)"
        )
    return path


def _tunable(name: str, field: str, text: str) -> flags.Flag:
    """A router flag that sets RouterConfig.`field` (its dest), typed and defaulted by that field."""
    default = getattr(RouterConfig, field)
    metavar = name.removeprefix("--").upper().replace("-", "_")  # argparse's, which a dest would change
    return flags.Flag(name, text, {"type": type(default), "default": default, "dest": field, "metavar": metavar})


# The router's own tunables, each declared once: main() builds RouterConfig from their dests.
TUNABLES = (
    _tunable("--node-timeout", "node_timeout_s", "drop a node after this many silent seconds (missed heartbeats)"),
    _tunable(
        "--stall-timeout",
        "stall_timeout_s",
        "drop a node that holds requests but completed no engine step for this many seconds "
        "(requests never time out while their node makes progress)",
    ),
    _tunable(
        "--max-queued-requests",
        "max_queued_requests",
        "requests always accepted into the router's queue beyond the nodes' capacity",
    ),
    _tunable(
        "--max-queue-wait-s",
        "max_queue_wait_s",
        "also queue requests while the measured service rate serves them within this many seconds; "
        "beyond both bounds: 429 with Retry-After",
    ),
    _tunable(
        "--max-body-bytes", "max_body_bytes", "refuse request bodies larger than this with 413, before parsing them"
    ),
    _tunable(
        "--max-prompt-chars",
        "max_prompt_chars",
        "refuse prompts (all prompts / messages of a request together) longer than this with 400, before tokenizing",
    ),
    _tunable(
        "--max-seqs-per-request",
        "max_sequences_per_request",
        "refuse requests asking for more sequences (prompts x n) than this with 400",
    ),
    _tunable(
        "--decode-wait",
        "decode_wait_s",
        "seconds a request whose decode node died waits for another decode node to register "
        "before it fails (it then resumes where it stopped)",
    ),
    _tunable(
        "--vllm-max-num-seqs",
        "vllm_max_num_seqs",
        "with --vllm-decode: sequences each vLLM decode instance runs at once (its --max-num-seqs), the admission "
        "queue's capacity per instance",
    ),
    _tunable(
        "--stats-interval",
        "stats_interval_s",
        "seconds between the periodic stats lines (throughput, running/waiting, KV usage, hit rates)",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ucm-serve router", description=__doc__)
    flags.HOST.add(p)
    flags.PORT.add(p)
    p.add_argument("--bind-nodes", default=defaults.NODES_ADDR, help="ZeroMQ address nodes connect to")
    p.add_argument("--model", default=None, help="the model folder (for the tokenizer); the default served name")
    flags.SERVED_MODEL_NAME.add(p)
    flags.API_KEY.add(p)
    flags.MAX_MODEL_LEN.add(p)
    for flag in TUNABLES:
        flag.add(p)
    p.add_argument(
        "--prefix-source",
        **flags.one_of(PrefixSource, RouterConfig.prefix_source),
        help="what prefix-aware pairing reads a node's device cache from: events = the KV events of nodes started "
        "with --kv-events-config (indexed by the router), heartbeat summaries for the others; heartbeat = the "
        "summaries alone (the policy before KV events)",
    )
    vllm = p.add_argument_group(
        "fronting vLLM (docs/vllm.md): vLLM instances with UCMConnector on one store daemon instead of ucm-serve "
        "nodes; --model is then the default served name, and a model folder's tokenizer lets the router look "
        "prompts up in the instances' KV events; --curve-keys only subscribes to the store's KV events"
    )
    vllm.add_argument(
        "--vllm-prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a vLLM instance running UCMConnector as kv_producer (http://HOST:PORT); repeat for more",
    )
    vllm.add_argument(
        "--vllm-decode",
        action="append",
        default=[],
        metavar="URL",
        help="a vLLM instance running UCMConnector as kv_consumer (http://HOST:PORT); repeat for more",
    )
    vllm.add_argument(
        "--vllm-kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT[,REPLAY]",
        help="the KV event publisher of the instance at URL (its --kv-events-config endpoint, and replay endpoint, "
        "as the router reaches them): the router indexes what its device cache holds and cost pairing prices it; "
        "repeat per instance",
    )
    p.add_argument(
        "--pairing",
        **flags.one_of(PairingPolicy, RouterConfig.pairing),
        help="how each request's prefill and decode node are picked (router/pairing.py): cost = the least expected "
        "seconds from each node's measured step costs (prompt tokens left after its device and store hits, the "
        "queue ahead, KV to bring), never past a node's admission bound; prefix-slack = the longest cached prefix "
        "within a load slack (the policy before); least-loaded, round-robin, dynamo, sglang: for comparison",
    )
    p.add_argument(
        "--store-kv-events",
        metavar="ENDPOINT[,REPLAY]",
        default=None,
        help="the store daemon's KV events (its --kv-events-config endpoint, and replay endpoint): the router indexes "
        "what the store's DRAM and disk hold and cost pairing prices those blocks as loads (CURVE with the store's "
        "server.key from --curve-keys unless --insecure)",
    )
    p.add_argument("--log-level", default="info")
    auth = p.add_argument_group("node authentication (ZeroMQ CURVE, docs/security.md)")
    flags.curve_keys(
        "router.key_secret + authorized/NODE.key (a node registers only as the node id its key file is named for)"
    ).add(auth)
    auth.add_argument("--server-key", metavar="FILE", default=None, help="the router's .key_secret file")
    auth.add_argument(
        "--authorized",
        metavar="DIR",
        default=None,
        help="folder of accepted node public keys, one NODE_ID.key per node",
    )
    flags.insecure("on the node socket: anyone who reaches it can register as a node").add(auth)
    return p


def node_auth_from_args(args: argparse.Namespace) -> ServerAuth | None:
    """The node socket's CURVE keys; None only with --insecure. ValueError for contradicting or missing flags."""
    if args.insecure and (args.curve_keys or args.server_key or args.authorized):
        raise ValueError("--insecure contradicts --curve-keys/--server-key/--authorized")
    auth = None
    if args.curve_keys:
        if args.server_key or args.authorized:
            raise ValueError("--curve-keys replaces --server-key and --authorized; give one or the other")
        auth = KeyPaths.of(args.curve_keys).router_auth()
    elif bool(args.server_key) != bool(args.authorized):
        raise ValueError("--server-key and --authorized go together")
    elif args.server_key:
        auth = ServerAuth(Path(args.server_key), Path(args.authorized))
    if auth is not None:
        if not Path(auth.secret_file).is_file():
            raise ValueError(f"router secret key {auth.secret_file} does not exist (`ucm-serve keys DIR` writes it)")
        if not auth.peer_names():
            raise ValueError(f"no node keys in {auth.authorized_dir}: no node could register")
        return auth
    if not args.insecure:
        raise ValueError(
            "the node socket needs keys (--curve-keys DIR, from `ucm-serve keys DIR --nodes ...`) "
            "or an explicit --insecure"
        )
    return None


def store_events_endpoint(text: str | None) -> P.KVEventsEndpoint | None:
    """`--store-kv-events ENDPOINT[,REPLAY]` -> where the router subscribes (vLLM's default topic, as the store's)."""
    if not text:
        return None
    endpoint, _, replay = text.partition(",")
    return P.KVEventsEndpoint(endpoint.strip(), replay.strip() or None, "")


def vllm_events_endpoints(texts: list[str]) -> tuple[tuple[str, P.KVEventsEndpoint], ...]:
    """`--vllm-kv-events URL=ENDPOINT[,REPLAY]`, each -> (the instance's normalized URL, its publisher)."""
    from router.vllm_backend import normalize_url

    out = []
    for text in texts:
        url, sep, events = text.partition("=")
        endpoint = store_events_endpoint(events)
        if not sep or endpoint is None:
            raise ValueError(f"--vllm-kv-events takes URL=ENDPOINT[,REPLAY], got {text!r}")
        out.append((normalize_url(url), endpoint))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.vllm_prefill or args.vllm_decode:
        return _front_vllm(args)
    try:
        node_auth = node_auth_from_args(args)
        folder = model_folder(args.model)
    except ValueError as e:
        print(f"ucm-serve router: {e}", file=sys.stderr)
        return 2
    config = RouterConfig(
        bind_nodes=args.bind_nodes,
        host=args.host,
        port=args.port,
        model=args.model,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_model_len=args.max_model_len,
        node_auth=node_auth,
        prefix_source=args.prefix_source,
        pairing=args.pairing,
        store_events=store_events_endpoint(args.store_kv_events),
        **{flag.kwargs["dest"]: getattr(args, flag.kwargs["dest"]) for flag in TUNABLES},
    )
    import uvicorn

    from engine.tokenizer import Tokenizer
    from router.app import create_app

    app = create_app(config, Tokenizer(folder))
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=config.host, port=config.port, log_level=args.log_level, loop="asyncio", access_log=False
        )
    )
    # The ready line (tests and `ucm-serve up` wait for it) is printed by the app's startup: see create_app.
    server.run()
    return 0


def _front_vllm(args: argparse.Namespace) -> int:
    """The router in front of vLLM instances: no node socket; vLLM tokenizes, the router only to look prompts up in
    the KV events (with a model folder's tokenizer)."""
    from router.vllm_backend import normalize_url

    try:
        config = RouterConfig(
            host=args.host,
            port=args.port,
            model=args.model or defaults.MODEL,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            vllm_prefill=tuple(normalize_url(u) for u in args.vllm_prefill),
            vllm_decode=tuple(normalize_url(u) for u in args.vllm_decode),
            vllm_kv_events=vllm_events_endpoints(args.vllm_kv_events),
            pairing=args.pairing,
            store_events=store_events_endpoint(args.store_kv_events),
            node_auth=KeyPaths.of(args.curve_keys).router_auth() if args.curve_keys else None,
            **{flag.kwargs["dest"]: getattr(args, flag.kwargs["dest"]) for flag in TUNABLES},
        )
    except ValueError as e:
        print(f"ucm-serve router: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from router.vllm_app import create_vllm_app

    tokenizer = None
    if args.model and (Path(args.model).expanduser() / "tokenizer.json").is_file():
        from engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(model_folder(args.model))

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call otherwise

    server = uvicorn.Server(
        uvicorn.Config(
            create_vllm_app(config, tokenizer),
            host=config.host,
            port=config.port,
            log_level=args.log_level,
            loop="asyncio",
            access_log=False,
        )
    )
    server.run()
    return 0
