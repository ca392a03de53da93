#!/usr/bin/env bash
# Makes sure a compose command is on this machine: tests/test_compose_files.py reads the compose files as
# docker-compose resolves them (override files merged, variables interpolated), and without one it can only
# read a single file itself. When neither `docker-compose` nor `docker compose` answers, installs Debian's
# docker-compose package if we are root and apt-get is there (running `apt-get update` once when the package
# is unknown); otherwise says how to get it. Never fails the caller: those tests then skip and say why.
set -uo pipefail
have() {
  docker-compose version --short >/dev/null 2>&1 || docker compose version --short >/dev/null 2>&1
}
have && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-cache show docker-compose >/dev/null 2>&1; then
    echo "compose: apt-get update (docker-compose is not in the package lists)" >&2
    apt-get update -qq >&2 || true
  fi
  echo "compose: apt-get install docker-compose (the compose files' tests read them through it)" >&2
  apt-get install -y -qq --no-install-recommends docker-compose >&2 || true
  have && exit 0
fi
echo "compose: no docker-compose here; 'apt-get install docker-compose' (as root) lets the compose files' tests" \
  "merge override files as docker-compose does" >&2
exit 0
