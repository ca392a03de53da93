"""The ``wafl`` command: parse (:mod:`wafl.cli.parser`), run the sub-command (:mod:`wafl.cli.commands`) and
turn its errors into exit statuses (2: a mistake in the command, 1: a run that failed or a server given up on)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from wafl.cli.launch.cgroups import CpuQuotaUnavailable
from wafl.cli.launch.netns import LinkShapingUnavailable
from wafl.cli.parser import build_parser
from wafl.common.config import ConfigError
from wafl.common.datasets.base import DatasetNotFoundError
from wafl.common.errors import RunAborted, UsageError

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the entry point a run's forked processes run (wafl.cli.launch.forking): handed down to the command, so that
    # the launch room never imports this module (which imports the commands, which import the launcher)
    args.entry = main
    try:
        return int(args.fn(args) or 0)
    except ConfigError as e:
        print(f"wafl: configuration error: {e}", file=sys.stderr)
        return 2
    except UsageError as e:
        print(f"wafl: {e}", file=sys.stderr)
        return 2
    except DatasetNotFoundError as e:  # names the dataset, the folder searched and how to get the files
        print(f"wafl: {e}", file=sys.stderr)
        return 2
    except RunAborted as e:  # wafl run stopped before its end (--timeout, every client failed)
        print(f"wafl: {e}", file=sys.stderr)
        return 1
    except ConnectionError as e:  # a client that gave up on the server (--reconnect-s)
        print(f"wafl: {e}", file=sys.stderr)
        return 1
    except (LinkShapingUnavailable, CpuQuotaUnavailable) as e:
        print(f"wafl: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
