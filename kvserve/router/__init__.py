"""Prefix-aware routing across replicas. `policies` holds the routing policies; the simulator
(kvserve/sim) drives them today, a router in front of engine processes can reuse them."""
