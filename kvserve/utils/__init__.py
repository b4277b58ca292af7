"""The leaves: modules that import nothing of kvserve (the standard library, and torch only
lazily), so any layer may use them without an upward edge. A module that starts importing
kvserve belongs with its concept, not here (tests/test_architecture.py checks it)."""
