#!/usr/bin/env python3
"""Entrypoint of the wafl container image: prepares the container, then runs the wafl CLI.

Usage:  wafl-entrypoint [wafl] COMMAND [ARGS...]      e.g. ``server --clients 4``, ``client``
        wafl-entrypoint --dry-run COMMAND [ARGS...]   print what would be done, as JSON; change nothing
        wafl-entrypoint --print-index                 print the client index this container derives
        wafl-entrypoint --health                      the container health check (gRPC health service)

The arguments are the wafl CLI's, unchanged; the process finally exec'd is
``python -m wafl.cli.main ARGS`` (what the ``wafl`` script and ``wafl run`` start). Before that:

1. ``client`` without ``--index`` and without ``WAFL_CLIENT_INDEX``: the index comes from
   ``WAFL_CLIENT_INDEX_FROM``:

   * ``claim`` (what docker-compose.yml sets; its containers share the host's network): the
     lowest free index from ``WAFL_CLIENT_INDEX_OFFSET`` on, claimed by binding the abstract
     Unix socket ``@wafl-client-index/<server>/<index>`` in the network namespace the clients
     share. The client process holds the socket for its lifetime (it is inherited across exec),
     so the kernel releases the index when the client exits, however it exits, and a restarted
     client takes a free one again; two clients can never hold the same index.
   * ``name`` (the default; containers on a user-defined network): the container's replica
     number, the trailing number of its name (``wafl-client-3`` or ``wafl_client_3`` -> replica 3
     -> index 2, plus ``WAFL_CLIENT_INDEX_OFFSET``). The name is taken from ``WAFL_CLIENT_NAME``,
     else from the hostname, else from a reverse DNS (PTR) query for the container's own address
     sent to the resolver in /etc/resolv.conf (Docker's embedded DNS answers
     ``<container name>.<network>``; /etc/hosts, which only knows the hostname, is not consulted).

   The index goes to the CLI as ``WAFL_CLIENT_INDEX``. No index: exit 2. A client without
   ``--server`` and ``WAFL_SERVER`` dials ``127.0.0.1:$WAFL_PORT`` (default 50051).
2. ``WAFL_LINK_RATE`` (e.g. ``20mbit``): ``server`` and ``client`` limit the egress of
   ``WAFL_LINK_DEV`` (default eth0) with ``python -m wafl.cli.launch.netns shape`` (tc tbf). That needs
   a network namespace of the container's own (not ``WAFL_HOST_NETWORK=1``, which says the
   container shares the host's: its eth0 is the host's interface) and CAP_NET_ADMIN, i.e. a
   container started as root with ``cap_add: [NET_ADMIN]``; without either the entrypoint exits
   77 with a message, or, when ``WAFL_LINK_OPTIONAL=1``, warns and goes on unshaped. ``bench`` and
   ``run`` get ``--link-rate`` instead (network namespaces of their own; root). ``WAFL_SERVER_LINK_RATE``,
   when set, is the server's rate instead (the server's link carries every client's traffic: ``wafl
   run --link-rate`` gives it the clients' sum).
3. ``WAFL_ARGS``: extra arguments appended to the command (split like a shell would).
4. Started as root: drops to the user ``WAFL_RUN_AS`` (default ``wafl``) unless that is empty or
   ``root``, or the command needs root (``bench``/``run`` with a link rate).
5. Writes ``WAFL_ROLE_FILE`` (default /tmp/wafl-role.json): the command and the address the
   health check probes. ``--health`` runs ``wafl health`` against it: a server probes itself,
   a client its server; other commands have nothing to probe and are healthy.

Only the standard library is used, so the script can be tested outside a container. Its pieces are
the modules of the ``wafl_entry`` package next to it (the image keeps both in /opt/wafl-entrypoint).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.realpath(__file__))  # where wafl_entry/ is, also when started through a link
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from wafl_entry.main import main  # noqa: E402  (found through the path set above)

if __name__ == "__main__":
    sys.exit(main())
