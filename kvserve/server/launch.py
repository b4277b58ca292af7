"""`kvserve serve`: load the engine, then serve the API with uvicorn until interrupted."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator

from kvserve.utils.logging_setup import init_logging, uvicorn_log_config

logger = logging.getLogger("kvserve")


def served_names(args: argparse.Namespace) -> list[str]:
    """vLLM's rule: --served-model-name, else the model as it was given; the embedded default
    answers to its own name."""
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model is not None:
        return [args.model]
    from kvserve.model_loader.default import NAME

    return [NAME]


def warm_up_gemms(engine) -> Iterator[None]:
    """Compile every oneDNN GEMM shape the engine can use (CPU, packed weights), one row count
    per `next`: the engine loop runs it while no request is there (`run_when_idle`).

    Why: a server under concurrent load meets a new batch size on many steps, and oneDNN keeps
    a compiled kernel per shape; warmed up at start, the server's memory reaches its steady
    level within seconds (docs/soak.md) and few requests wait on a compile. Why not before
    serving: it is up to 2e11 FLOPs (1.5 s on a quiet 2-core machine, 20 s on a busy one),
    and /health waited for it; a request that comes first compiles its own shape, as it did
    without the warm-up."""
    import time

    from kvserve.layers.selection import warm_up_steps

    cfg = engine.config
    if engine.model is None:  # tensor parallelism: the model is in the workers (dense)
        return
    start = time.monotonic()
    warmed = 0
    for _ in warm_up_steps(engine.model, cfg.max_num_batched_tokens, cfg.max_num_seqs):
        warmed += 1
        yield
    if warmed:
        logger.info("compiled the GEMMs for %d batch sizes in %.1f s (while idle)", warmed,
                    time.monotonic() - start)


def access_policy(args: argparse.Namespace):
    """Keys, roles and isolation from the flags (server/auth.py)."""
    from kvserve.server.auth import AccessPolicy
    from kvserve.frontend.tenancy import Credentials

    credentials = Credentials.from_args(args.api_key, args.api_key_file, args.admin_api_key,
                                        os.environ)
    return AccessPolicy.build(credentials, protect_all=args.api_key_protect_all,
                              allow_unauthenticated_admin=args.allow_unauthenticated_admin,
                              kv_isolation=args.kv_isolation, tenant_by=args.kv_tenant_by)


def run_server(args: argparse.Namespace, engine_kwargs: dict) -> int:
    import uvicorn

    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.server.app import build_app

    init_logging()
    for flag in ("max_waiting_requests", "max_seqs_per_request", "max_request_body_bytes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, flag)}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    access = access_policy(args)  # a bad key or flag fails before the model loads
    if engine_kwargs.get("node_rank", 0) > 0:  # another node's ranks: no engine core, no API
        from kvserve.config import EngineConfig
        from kvserve.parallel.build import run_node

        return run_node(EngineConfig.from_kwargs(**engine_kwargs))
    engine = AsyncLLMEngine.from_kwargs(max_waiting_requests=args.max_waiting_requests,
                                        max_seqs_per_request=args.max_seqs_per_request,
                                        log_stats=not args.disable_log_stats,
                                        log_interval=args.log_stats_interval, **engine_kwargs)
    engine.run_when_idle(warm_up_gemms(engine))
    names = served_names(args)
    app = build_app(engine, names, access, max_request_body_bytes=args.max_request_body_bytes,
                    request_log=getattr(args, "request_log", None))
    from kvserve.server import debug_memory

    if debug_memory.enabled():  # opt-in diagnostics: GET /debug/memory (docs/soak.md)
        debug_memory.install(app, engine)
        logger.warning("%s is set: /debug/memory is served (diagnostics only)",
                       debug_memory.ENV_VAR)
    logger.info("serving %s (%s) on http://%s:%d", names[0], engine.config.model, args.host,
                args.port)
    logger.info("%s; KV isolation by %s", access.describe_admin(), access.kv_isolation)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_keep_alive=5, timeout_graceful_shutdown=10, access_log=False,
                log_config=uvicorn_log_config())
    return 0
