"""Benchmarks: each module exposes main(argv) -> int and prints a table then one JSON line."""
