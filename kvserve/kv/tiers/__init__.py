"""Storage tiers under the device KV pool: host memory, local disk, Redis."""
