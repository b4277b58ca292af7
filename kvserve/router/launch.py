"""`kvserve route`: the gateway's flags and entry point (argparse only at import, so building
the CLI parser stays cheap)."""

from __future__ import annotations

import argparse
import logging
import os

from kvserve.utils.cli_flags import add_balance_args
from kvserve.router.policies import GATEWAY_POLICIES
from kvserve.frontend.tenancy import KV_ISOLATION

logger = logging.getLogger("kvserve.router")


def add_route_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", default=None, metavar="URL",
                   help="a `kvserve serve` base URL, e.g. http://10.0.0.5:8000; repeat per "
                   "replica (or give --prefill and --decode instead)")
    p.add_argument("--prefill", action="append", default=None, metavar="URL",
                   help="prefill/decode disaggregation: a prefill instance's base URL (chosen "
                   "by --policy; it computes the prompt and keeps its KV for a decode "
                   "instance); repeat per instance; needs --decode")
    p.add_argument("--decode", action="append", default=None, metavar="URL",
                   help="a decode instance's base URL (the least loaded one gets each request "
                   "with the prefill's kv_transfer_params); repeat per instance; needs "
                   "--prefill")
    p.add_argument("--policy", choices=GATEWAY_POLICIES, default="cache_aware")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the served model's checkpoint directory ('default': the embedded "
                   "default model): text prompts and chat messages are tokenized with its "
                   "tokenizer and chat template, so prefix keys are the replicas' block hashes; "
                   "without it text is keyed by its bytes (token-id prompts always match)")
    p.add_argument("--block-size", type=int, default=16,
                   help="the replicas' --block-size (default 16, kvserve serve's default)")
    add_balance_args(p, slack=4, slack_why=": at low load, one busy request is not a hot "
                     "replica")
    p.add_argument("--no-spread", dest="spread", action="store_false",
                   help="cache_aware: send a request nobody caches to the lowest-numbered of "
                   "the least loaded replicas (default: the one caching the fewest blocks, so "
                   "new prefixes spread out)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a client key, checked at the gateway (401 there) and sent on to the "
                   "replicas with the request, as the client's Authorization header always is; "
                   "repeat per key (also KVSERVE_API_KEY)")
    p.add_argument("--api-key-file", metavar="FILE", default=None,
                   help="more client keys, one per line (as kvserve serve's)")
    p.add_argument("--admin-api-key", default=None, metavar="KEY",
                   help="the replicas' admin key: what the gateway reads their /v1/kv_events "
                   "with (also KVSERVE_ADMIN_API_KEY)")
    p.add_argument("--kv-isolation", choices=KV_ISOLATION,
                   default="cache_salt",
                   help="the replicas' --kv-isolation, so that prefix keys name the blocks the "
                   "replicas cache (under api_key, the client's key is part of them)")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between health checks of each replica (default 1)")
    p.add_argument("--upstream-timeout", type=float, default=600.0,
                   help="the longest wait in seconds for any read from a replica (default 600)")
    p.add_argument("--prefill-timeout", type=float, default=None,
                   help="--prefill/--decode: the longest wait in seconds for a prefill "
                   "instance's answer, after which the decode instance computes the prompt "
                   "itself (default: --upstream-timeout)")
    p.add_argument("--max-request-body-bytes", type=int, default=32 * 1024**2,
                   help="larger request bodies get 413 at the gateway (default 32 MiB, as "
                   "kvserve serve)")
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="do not subscribe to the replicas' /v1/kv_events (routing history only)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def load_tokenizer(path: str | None):
    if path is None:
        return None
    from kvserve.tokenizer.tokenizer import Tokenizer

    from kvserve.model_loader.default import NAME, embedded_model_path
    from kvserve.model_loader.gguf_checkpoint import tokenizer_dir

    if path in ("default", NAME):  # the model `kvserve serve` runs when given none
        path = str(embedded_model_path())
    return Tokenizer.from_dir(tokenizer_dir(path))


def check_mode(args: argparse.Namespace) -> bool:
    """Which gateway the flags ask for: True for prefill/decode disaggregation (--prefill and
    --decode), False for replicas (--replica); anything else is a ValueError that says what to
    give."""
    pd = bool(args.prefill or args.decode)
    if args.replica and pd:
        raise ValueError("--replica cannot be combined with --prefill/--decode: give either "
                         "--replica URL ... or --prefill URL ... --decode URL ...")
    if pd and not args.decode:
        raise ValueError("--prefill needs --decode URL (the instances that generate the "
                         "answer)")
    if pd and not args.prefill:
        raise ValueError("--decode needs --prefill URL (the instances that compute the "
                         "prompt)")
    if not (args.replica or pd):
        raise ValueError("give --replica URL (repeat per replica), or --prefill URL and "
                         "--decode URL")
    if args.prefill_timeout is not None and args.prefill_timeout <= 0:
        raise ValueError(f"--prefill-timeout must be > 0, got {args.prefill_timeout}")
    return pd


def build_gateway(args: argparse.Namespace):
    from kvserve.router.app import Gateway, RouterConfig
    from kvserve.router.disagg import DisaggGateway, disagg_pools
    from kvserve.router.keys import PrefixKeyer
    from kvserve.router.policies import make_policy
    from kvserve.router.replicas import ReplicaState
    from kvserve.frontend.tenancy import Credentials

    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got "
                         f"{args.max_request_body_bytes}")
    pd = check_mode(args)
    if pd:
        replicas, decode = disagg_pools(args.prefill, args.decode, args.block_size)
    else:
        urls = list(dict.fromkeys(args.replica))
        replicas = [ReplicaState(i, url, args.block_size) for i, url in enumerate(urls)]
    policy = make_policy(args.policy, len(replicas), args.block_size,
                         balance_factor=args.balance_factor, key_tokens=args.hash_key_tokens,
                         balance_slack=args.balance_slack, spread=args.spread)
    keyer = PrefixKeyer(args.block_size, load_tokenizer(args.tokenizer), args.kv_isolation)
    credentials = Credentials.from_args(args.api_key, args.api_key_file, None, os.environ)
    config = RouterConfig(credentials=credentials,
                          admin_api_key=args.admin_api_key
                          or os.environ.get("KVSERVE_ADMIN_API_KEY"),
                          health_interval_s=args.health_interval,
                          upstream_timeout_s=args.upstream_timeout, kv_events=args.kv_events,
                          max_request_body_bytes=args.max_request_body_bytes,
                          prefill_timeout_s=args.prefill_timeout)
    if pd:
        return DisaggGateway(replicas, decode, policy, keyer, config)
    return Gateway(replicas, policy, keyer, config)


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.utils.logging_setup import init_logging, uvicorn_log_config
    from kvserve.router.app import build_router_app
    from kvserve.router.disagg import DisaggGateway

    init_logging()
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    gateway = build_gateway(args)
    app = build_router_app(gateway)
    if isinstance(gateway, DisaggGateway):
        logger.info("prefill/decode: %s over %d prefill, least_loaded over %d decode "
                    "instances on http://%s:%d", args.policy, len(gateway.replicas),
                    len(gateway.decode.replicas), args.host, args.port)
    else:
        logger.info("routing %s over %d replicas on http://%s:%d", args.policy,
                    len(gateway.replicas), args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_keep_alive=5, timeout_graceful_shutdown=10, access_log=False,
                log_config=uvicorn_log_config())
    return 0
