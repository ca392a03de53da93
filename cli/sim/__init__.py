"""In-process runs: the server's engine and every client in one process (:mod:`.simulate`), talking through
an in-memory transport (:mod:`.local_transport`) instead of gRPC. Reaches the client only through its public
interface for hosts (:mod:`wafl.client.hosting`; tests/test_client_hosting.py checks it). Imports neither
:mod:`wafl.cli.launch` nor :mod:`wafl.cli.report`."""
