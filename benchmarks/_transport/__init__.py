"""The pieces of ``benchmarks/transport.py`` (the command line), one job each.

* :mod:`.common`: the repository root, the MB unit, the log line;
* :mod:`.procfs`: /proc readers (memory, per-thread CPU, load average) and an RSS sampler;
* :mod:`.lifetime`: how the benchmark's child processes end with it;
* :mod:`.tcp`: the raw TCP loopback reference;
* :mod:`.grpc_alone`: one upload's messages through a bare ``grpc.aio`` stream;
* :mod:`.client`: the benchmark clients (a pool of worker processes running ``Session`` uploads);
* :mod:`.server`: the ``wafl server`` under test, as a process;
* :mod:`.diagnostics`: the diagnostic servers changed at start-up by a ``sitecustomize`` module;
* :mod:`.phases`: the measured phases (single client, concurrent clients, no-op round, stage times);
* :mod:`.stage_costs`: the per-step cost of the chunk path, in-process;
* :mod:`.run`: the measurement run, phase after phase;
* :mod:`.report`: the targets and their checks, the machine, the JSON file and the printed summary.
"""
