"""The `kvserve serve` flags beyond the shared engine flags of `kvserve.entrypoints.cli.add_engine_args`
(vLLM's names; --kv-cache-dtype is an engine flag, EngineConfig.kv_cache_dtype). Only argparse
here, so that building the CLI parser stays cheap."""

from __future__ import annotations

import argparse

from kvserve.frontend.tenancy import KV_ISOLATION
from kvserve.utils.validation import (DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_SEQS_PER_REQUEST,
                                DEFAULT_MAX_WAITING_REQUESTS)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) the API answers to (default: MODEL as given, or "
                        "SmolLM2-135M-Instruct for the embedded default model); the first one "
                        "is used in responses")
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* (as vLLM; /health, "
                        "/metrics, /version and the API docs stay open unless "
                        "--api-key-protect-all); repeat for several callers (also "
                        "KVSERVE_API_KEY)")
    parser.add_argument("--api-key-file", metavar="FILE", default=None,
                        help="more API keys, one per line (llama-server's flag; '#' lines "
                        "and blank lines skipped)")
    parser.add_argument("--admin-api-key", action="append", default=None, metavar="KEY",
                        help="the only credential for what reaches every caller's cache: "
                        "/reset_prefix_cache, /v1/kv_events, the full /v1/cache/explain and "
                        "kv_cache_report (cached text, the salt reason), other callers' pins; "
                        "repeatable (also KVSERVE_ADMIN_API_KEY)")
    parser.add_argument("--allow-unauthenticated-admin", action="store_true",
                        help="serve the admin endpoints and full cache reports without an "
                        "admin key: to everybody when no key is given, to every key holder "
                        "otherwise (never the default, on a loopback --host too)")
    parser.add_argument("--kv-isolation", choices=KV_ISOLATION,
                        default="cache_salt",
                        help="who may share cached KV blocks: everybody (none: cache_salt is "
                        "ignored), requests of the same cache_salt (default, vLLM's rule), or "
                        "requests of the same API key, subdivided by cache_salt (api_key: one "
                        "tenant's cached prefix never shortens another's time to first token)")
    parser.add_argument("--api-key-protect-all", action="store_true",
                        help="with API keys, require one on every route but /health: "
                        "/metrics, /version, /docs, /redoc and /openapi.json too")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="sequences (prompts x n) that may wait for a slot; more get 429 "
                        "(retry later), a request larger than this 400 (default 1024)")
    parser.add_argument("--max-seqs-per-request", type=int, default=DEFAULT_MAX_SEQS_PER_REQUEST,
                        help="most sequences (prompts x n) one request may ask for; more "
                        "get 400 (default 1024)")
    parser.add_argument("--max-request-body-bytes", type=int,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413 (default 32 MiB)")
    parser.add_argument("--request-log", metavar="FILE", default=None,
                        help="append one JSON line per finished request (time, cache_salt, the "
                        "prompt or chat messages, prompt and cached tokens) after a header with "
                        "the KV pool's size: what `kvserve diagnose` reads")
    parser.add_argument("--kv-tenant-by", choices=["cache_salt", "api_key"], default=None,
                        help="who a cached block belongs to under --kv-tenant-quota: the "
                        "request's cache namespace (its cache_salt), or its API key (default: "
                        "api_key under --kv-isolation api_key, else cache_salt)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic throughput/cache log line")
    parser.add_argument("--log-stats-interval", type=float, default=10.0,
                        help=argparse.SUPPRESS)
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
