"""Benchmark helpers and contenders (torch is optional and imported lazily)."""
