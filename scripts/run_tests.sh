#!/usr/bin/env bash
# The whole test suite. Called by `make test` (and so by CI) after the .venv is set up.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Redis tier is tested against a real server (tests/conftest.py starts it on a free port).
if ! command -v redis-server >/dev/null 2>&1; then
    echo "installing redis-server (apt-get) for the Redis tier tests" >&2
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null && \
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null \
        || echo "could not install redis-server: the Redis tier tests will fail" >&2
fi
export KVSERVE_CACHE_DIR="${KVSERVE_CACHE_DIR:-$PWD/.kvserve-cache}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
