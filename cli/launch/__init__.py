"""Launching a run's processes: the server, the workers and the clients started or forked on this machine
(:mod:`.launcher`, :mod:`.forking`), behind network namespaces and shaped links (:mod:`.netns`), in control
groups with CPU shares (:mod:`.cgroups`), on a Ray cluster (:mod:`.raylaunch`), and one federation measured for a
benchmark (:mod:`.measured`). Imports neither :mod:`wafl.cli.sim` nor :mod:`wafl.cli.report`."""
