"""Shared tooling for the kernel workspace: build, checks, hub server, publish, lock, benchmarks."""
