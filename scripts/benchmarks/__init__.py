"""synflow's benchmark harness, run by ``scripts/bench``.

Each benchmark is a module with ``run(quick, progress) -> dict`` that measures
its figures *and* the ceiling they are compared with in the same run (so the
ratio holds on a noisy machine). :mod:`scripts.benchmarks.runner` repeats them,
aggregates the repetitions and writes ``bench.json``, ``bench.md`` and the
plots. See ``docs/benchmarks.md``.
"""

#: The benchmarks, in the order they run.
BENCHMARKS = ("codec", "tcp", "redis", "persist", "federation", "audit", "memory", "mainjob", "reshard", "spark")
