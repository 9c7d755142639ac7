"""Benchmarks of mstar_async against baselines; run them with ``mstar bench``.

- ``benchmarks.common``: timing, summary statistics, ratio tables, machine facts, progress.
- ``benchmarks.decode``: text decoding throughput (``mstar bench decode``).

Benchmarks measure; they are never timed unit tests. Their own tests (``tests/benchmarks``)
check the harness's arithmetic and that every system really generated what it was asked to.
"""
