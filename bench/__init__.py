"""End-to-end benchmarks: our system in local mode against single-process baselines, same data."""
