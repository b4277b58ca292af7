#!/usr/bin/env bash
# The whole test suite. Called by `make test` (and so by CI) after the .venv is set up.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVSERVE_CACHE_DIR="${KVSERVE_CACHE_DIR:-$PWD/.kvserve-cache}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
