"""Oracles the tests and tools check rtd_scale against; never imported by ``rtd_scale``."""
