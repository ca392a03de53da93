"""Experiments made of many runs: a sweep over a grid (:mod:`.sweep`, each point launched or simulated) and the
benchmarks (:mod:`.bench`, :mod:`.bench_async`: measured launches, then their report). The layer above the
rooms it composes (:mod:`wafl.cli.launch`, :mod:`wafl.cli.sim`, :mod:`wafl.cli.report`)."""
