"""The `kvserve serve` flags beyond the shared engine flags of `kvserve.cli.add_engine_args`
(vLLM's names; --kv-cache-dtype is an engine flag, EngineConfig.kv_cache_dtype). Only argparse
here, so that building the CLI parser stays cheap."""

from __future__ import annotations

import argparse

from kvserve.validation import (DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_SEQS_PER_REQUEST,
                                DEFAULT_MAX_WAITING_REQUESTS)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) the API answers to (default: MODEL, or 'default' "
                        "for the embedded default model); the first one is used in responses")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* and "
                        "/reset_prefix_cache (as vLLM; /health, /metrics, /version and the "
                        "API docs stay open unless --api-key-protect-all)")
    parser.add_argument("--api-key-protect-all", action="store_true",
                        help="with --api-key, require the key on every route but /health: "
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
    parser.add_argument("--kv-tenant-by", choices=["cache_salt", "api_key"], default="cache_salt",
                        help="who a cached block belongs to under --kv-tenant-quota: the "
                        "request's cache_salt, or its API key (the bearer token, as a digest)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic throughput/cache log line")
    parser.add_argument("--log-stats-interval", type=float, default=10.0,
                        help=argparse.SUPPRESS)
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
