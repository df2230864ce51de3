"""The benchmark suite: every figure is a ratio against the floor or a peer, measured in the same run.

Run ``python -m benchmarks.run [--quick] [--json PATH]`` (``make bench`` / ``make bench-quick``).

Plug-ins: every module ``benchmarks/bench_*.py`` exposes ``run(ctx: Ctx) -> list[Row]`` (see
:mod:`benchmarks._harness`); raise :class:`~benchmarks._harness.Skip` when a benchmark cannot run here
(a missing server, say). The runner discovers the modules by name, runs them in order and prints one table.
"""
