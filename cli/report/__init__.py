"""Reading finished runs: the seed table (:mod:`.table`), curves (:mod:`.curves`), measurements of a run's model
(:mod:`.analyze`), a run folder's records and timelines (:mod:`.run_records`, :mod:`.timeline_stats`), the
benchmarks' plots and text summaries (:mod:`.bench_plots`, :mod:`.text_columns`) and the commit a result was
made at (:mod:`.provenance`). Imports neither :mod:`wafl.cli.launch` nor :mod:`wafl.cli.sim`."""
