"""Benchmarks (`lockgate bench ...`), their harness and the locust suite; not in the wheel."""
