#!/usr/bin/env python3
"""This machine's pip settings, made usable inside ``docker build`` without entering an image layer.

pip on a build machine may depend on settings that name local things: a CA bundle (a proxy's),
wheel folders and package indexes on local disk (``find-links``, ``file://`` indexes), constraint
files. Inside a build container none of these paths exist. ``serve OUT`` gathers the settings pip
would use here (its configuration files, then ``PIP_*`` variables), then

* writes ``OUT/pip.conf``: the same settings with every local path replaced, folders and files by
  ``http://127.0.0.1:PORT/...`` URLs that this process serves (read-only, on loopback only, while
  it runs), the CA bundle by ``/run/secrets/pip-cert``; settings that name local output paths
  (``cache-dir``, ``log``, ``target``, ...) or would break a virtual environment (``user``) are left out;
* copies the CA bundle to ``OUT/pip-cert``;
* writes ``OUT/ready`` (the port) and serves until SIGTERM/SIGINT.

The build passes the two files as build secrets (``--secret id=pip.conf,src=OUT/pip.conf
--secret id=pip-cert,src=OUT/pip-cert``) and runs with ``--network host`` so that its RUN steps
reach the loopback server; docker/Dockerfile points pip at the secrets only in the RUN that
installs packages. ``show`` prints the rewritten configuration without serving anything.

Only the standard library is used (the script runs with the machine's python3, before any
virtual environment exists).
"""

from __future__ import annotations

import argparse
import configparser
import http.server
import os
import posixpath
import shutil
import signal
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path

CERT_SECRET = "/run/secrets/pip-cert"
# Options whose values name local paths of another kind or that make no sense in the image's venv.
DROPPED = {
    "cache-dir",
    "log",
    "log-file",
    "src",
    "target",
    "prefix",
    "root",
    "report",
    "dest",
    "download",
    "wheel-dir",
    "user",
    "config-file",
    "client-cert",
}
INDEX_KEYS = {"index-url", "extra-index-url"}
LOCATION_KEYS = {"find-links", "constraint", "requirement"}


def config_files(env: Mapping[str, str], home: Path) -> list[Path]:
    """pip's configuration files, lowest priority first (global, user, then PIP_CONFIG_FILE)."""
    xdg_dirs = [d for d in (env.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":") if d]
    files = [Path(d) / "pip" / "pip.conf" for d in xdg_dirs] + [Path("/etc/pip.conf")]
    files += [home / ".pip" / "pip.conf", Path(env.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf"]
    extra = env.get("PIP_CONFIG_FILE")
    if extra == os.devnull:
        return []
    if extra:
        files.append(Path(extra))
    return files


def _canonical(key: str) -> str:
    key = key.strip().lower().replace("_", "-")
    return key[2:] if key.startswith("--") else key


def load_settings(env: Mapping[str, str], files: Iterable[Path]) -> dict[str, dict[str, str]]:
    """section -> option -> value, as pip would see them: later files win, ``PIP_*`` variables win over files."""
    sections: dict[str, dict[str, str]] = {}
    for path in files:
        if not path.is_file():
            continue
        parser = configparser.RawConfigParser()
        parser.read(path)
        for section in parser.sections():
            for key, value in parser.items(section):
                sections.setdefault(section, {})[_canonical(key)] = value
    for name, value in env.items():
        if not name.startswith("PIP_") or name == "PIP_CONFIG_FILE":
            continue
        key = _canonical(name[4:])
        for options in sections.values():
            options.pop(key, None)
        sections.setdefault("global", {})[key] = value
    return sections


def _local_path(token: str, cwd: Path) -> Path | None:
    """The local path a value names (``file://`` URL or a path), or None for a remote URL."""
    parsed = urllib.parse.urlparse(token)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:  # http, https, ... (one letter: a Windows drive)
        return None
    return cwd / token


class Rewriter:
    """Rewrites local paths to URLs under ``base_url`` and remembers what to serve."""

    def __init__(self, base_url: str, cwd: Path) -> None:
        self.base_url = base_url.rstrip("/")
        self.cwd = cwd
        self.served: dict[str, Path] = {}  # URL prefix (a number) -> local folder or file
        self.cert: Path | None = None
        self.notes: list[str] = []

    def _serve(self, path: Path) -> str:
        for prefix, served in self.served.items():
            if served == path:
                return prefix
        prefix = str(len(self.served))
        self.served[prefix] = path
        return prefix

    def location(self, key: str, token: str) -> str | None:
        path = _local_path(token, self.cwd)
        if path is None:
            return token
        path = path.resolve()
        if not path.exists():
            self.notes.append(f"{key}: {token} does not exist here; left out")
            return None
        if key in INDEX_KEYS and path.is_dir():
            # an index's pages may link up and sideways (../../files/x.whl): serve its parent
            return f"{self.base_url}/{self._serve(path.parent)}/{urllib.parse.quote(path.name)}/"
        if path.is_dir():
            return f"{self.base_url}/{self._serve(path)}/"
        return f"{self.base_url}/{self._serve(path)}/{urllib.parse.quote(path.name)}"

    def rewrite(self, settings: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for section, options in settings.items():
            for key, value in options.items():
                if key in DROPPED:
                    self.notes.append(f"{key} left out (a local path or setting that does not apply in the image)")
                    continue
                if key == "cert":
                    cert = _local_path(value.strip(), self.cwd)
                    if cert is None or not cert.is_file():
                        self.notes.append(f"cert: {value} is not a file here; left out")
                        continue
                    self.cert = cert
                    value = CERT_SECRET
                elif key in INDEX_KEYS or key in LOCATION_KEYS:
                    tokens = [self.location(key, t) for t in value.split()]
                    kept = [t for t in tokens if t]
                    if not kept:
                        continue
                    value = " ".join(kept)
                out.setdefault(section, {})[key] = value
        return out


def render(settings: Mapping[str, Mapping[str, str]]) -> str:
    lines = ["# pip settings of the build machine, rewritten for a docker build (scripts/pip-settings.py)"]
    for section, options in settings.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {value}" for key, value in options.items()]
    return "\n".join(lines) + "\n"


class Handler(http.server.SimpleHTTPRequestHandler):
    """GET/HEAD under ``/<prefix>/...``: the folder served under that prefix, or its one file."""

    served: dict[str, Path] = {}

    def translate_path(self, path: str) -> str:
        url_path = urllib.parse.urlsplit(path).path
        parts = [p for p in posixpath.normpath(urllib.parse.unquote(url_path)).split("/") if p not in ("", ".", "..")]
        root = self.served.get(parts[0]) if parts else None
        if root is None:
            return "/nonexistent/"
        if root.is_file():
            return str(root) if parts[1:] == [root.name] else "/nonexistent/"
        target = str(root.joinpath(*parts[1:]))
        return target + "/" if url_path.endswith("/") else target

    def log_message(self, format: str, *args: object) -> None:
        if os.environ.get("WAFL_PIP_SETTINGS_LOG"):
            super().log_message(format, *args)


def prepare(out: Path, port: int, env: Mapping[str, str], home: Path, cwd: Path) -> Rewriter:
    rewriter = Rewriter(f"http://127.0.0.1:{port}", cwd)
    settings = rewriter.rewrite(load_settings(env, config_files(env, home)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "pip.conf").write_text(render(settings))
    cert = out / "pip-cert"
    if rewriter.cert is not None:
        shutil.copyfile(rewriter.cert, cert)
    elif cert.exists():
        cert.unlink()
    return rewriter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="write OUT/pip.conf and OUT/pip-cert, then serve the local paths on loopback")
    s.add_argument("out", type=Path)
    sub.add_parser("show", help="print the rewritten configuration (URLs with port 0), serve nothing")
    a = parser.parse_args(argv)
    env, home, cwd = os.environ, Path.home(), Path.cwd()
    if a.command == "show":
        rewriter = Rewriter("http://127.0.0.1:0", cwd)
        print(render(rewriter.rewrite(load_settings(env, config_files(env, home)))), end="")
        for prefix, path in rewriter.served.items():
            print(f"# /{prefix}/ -> {path}")
        for note in rewriter.notes:
            print(f"# {note}")
        return 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    rewriter = prepare(a.out, port, env, home, cwd)
    Handler.served = rewriter.served
    for note in rewriter.notes:
        print(f"pip-settings: {note}", file=sys.stderr)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    (a.out / "ready").write_text(f"{port}\n")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
