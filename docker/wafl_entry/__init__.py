"""The pieces of the container entrypoint (``docker/entrypoint.py``, ``wafl-entrypoint`` in the image), one
job each; only the standard library is used, so they are tested outside a container.

* :mod:`.errors`: the program's name, :class:`~.errors.EntrypointError` and its exit codes;
* :mod:`.args`: reading the wafl command line and the environment (command, options, server address);
* :mod:`.dns`: this container's addresses and a PTR query to its resolver (a hand-written DNS client);
* :mod:`.claims`: a client index claimed by binding an abstract Unix socket;
* :mod:`.index`: the client index, from the environment, a claim or a replica name;
* :mod:`.shaping`: CAP_NET_ADMIN, and shaping the container's link with ``wafl.cli.launch.netns shape``;
* :mod:`.privileges`: the drop from root to the unprivileged user;
* :mod:`.health`: what the health check probes, the role file it reads, the ``wafl health`` command;
* :mod:`.plan`: everything the entrypoint will do for a command, computed without side effects;
* :mod:`.main`: the entrypoint's modes (run, ``--dry-run``, ``--print-index``, ``--health``).
"""
