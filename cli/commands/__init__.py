"""The bodies of the ``wafl`` sub-commands, one module per family: each ``cmd_*`` takes the parsed flags
and returns the exit status (the errors it raises become exit statuses in :func:`wafl.cli.main.main`)."""
