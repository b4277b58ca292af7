"""How a tenant is named where others can read it (metric labels, the prefix tree's view):
a short digest, never the cache salt or API key itself, which are meant to be secret.

A module of its own, importing nothing of kvserve, so that a reader of figures (the
Prometheus exporter) names tenants as the tree view does without depending on the cache.
"""

from __future__ import annotations

import hashlib


def tenant_digest(tenant: str) -> str | None:
    """A tenant as the metrics label it (server/metrics.py's tenant_label): never the salt."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:12] if tenant else None
