"""Offline tools, outside serving: routing-trace replay (hit rate vs cache size) and the quality harness."""
