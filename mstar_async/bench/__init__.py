"""Benchmarks of mstar_async against baselines; run them with ``mstar bench``.

- ``mstar_async.bench.report``: the one shape of every benchmark's JSON report.
- ``mstar_async.bench.common``: statistics, ratio tables, machine facts, progress.
- one module per benchmark: ``decode``, ``transport``, ``image``, ``rollout``, ``vla``,
  ``speech``, ``overhead`` (``mstar bench NAME``); ``prompts/`` holds the speech prompts.

The baselines need the ``bench`` extra (``pip install 'mstar-async[bench]'``: transformers for
``decode``, matplotlib for the plots). Nothing here is imported by ``import mstar_async``; the
CLI imports a benchmark's module by name when its subcommand runs.

Benchmarks measure; they are never timed unit tests. Their own tests (``tests/benchmarks``)
check the harness's arithmetic and that every system really generated what it was asked to.
"""
