"""What the HTTP server (kvserve/server/) and the gateway (kvserve/router/) share, in one package
because the gateway imports nothing of the server: Anthropic's error shape (anthropic_errors.py)
and who a request comes from with its cache namespace (tenancy.py)."""
