"""Load generator for OpenAI-compatible servers (`servelm bench`).

datasets: prompt sources; client: one timed streaming request; runner: concurrency and
Poisson scheduling; report: statistics, table and JSON; plot: one run's picture; sweep: a
concurrency sweep's roofline and picture; cli: the subcommand.
"""

from servelm.bench.cli import add_bench_parser, run_bench

__all__ = ["add_bench_parser", "run_bench"]
