#!/usr/bin/env bash
# The whole test suite. Called by `make test` (and so by CI) after the .venv is set up.
set -euo pipefail
cd "$(dirname "$0")/.."
# Real parts the tests drive: a Redis server for the Redis tier (tests/conftest.py starts it on a
# free port), and Debian's Chromium with its driver for the web page (tests/test_web_page.py).
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} (apt-get) for the tests that use them" >&2
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null && \
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null \
        || echo "could not install ${missing[*]}: the tests that use them will fail" >&2
fi
export KVSERVE_CACHE_DIR="${KVSERVE_CACHE_DIR:-$PWD/.kvserve-cache}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
