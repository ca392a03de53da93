#!/usr/bin/env bash
# A private Docker engine on this machine, to build the wafl image and run the compose files
# where no container registry is reachable. As root, from anywhere:
#
#   docker/local-engine.sh                      build the images, print what was built, stop
#   docker/local-engine.sh COMMAND [ARGS...]    the same, then run COMMAND against the engine
#   docker/local-engine.sh bash                 an interactive shell with the engine
#
# 1. Installs what is missing (Debian packages docker.io, docker-compose, debootstrap; the
#    system's own Docker service is not started or enabled).
# 2. Starts a private dockerd: its own data root ($WAFL_ENGINE_DIR/data, default
#    /var/cache/wafl/engine, kept across runs so that images and the build cache are reused),
#    exec root, socket and pid file under $WAFL_ENGINE_RUN (default /run/wafl-engine), its own
#    containerd namespace; --bridge=none --iptables=false --ip-forward=false: it creates no
#    bridge, takes no private address range, adds no firewall rule and changes no sysctl.
#    Containers use the host's network (docker/docker-compose.yml does) or none.
# 3. Builds the base image wafl-base:bookworm once (debootstrap --variant=minbase of Debian
#    bookworm with python3, python3-venv, iproute2, tini, from the machine's Debian mirror;
#    imported with `docker import`), rebuilt only when its recipe changes; WAFL_BASE_IMAGE names
#    another base already in the engine instead (e.g. python:3.11-slim-bookworm after
#    `docker load`).
# 4. Builds the wafl image (docker/Dockerfile, BuildKit, --network host) as $WAFL_IMAGE (default
#    wafl:$WAFL_TORCH_VARIANT) with TORCH_VARIANT=$WAFL_TORCH_VARIANT (default pypi: the wheels
#    this machine's pip finds). The machine's pip settings reach the one RUN that installs
#    packages as build secrets, with the local folders they name served on loopback
#    (scripts/pip-settings.py); no layer holds them. BuildKit's cache makes an unchanged rebuild
#    take seconds, and a source change rebuild only the package layers.
# 5. Runs COMMAND with DOCKER_HOST, PATH (the engine's own docker CLI first, `docker compose`
#    running docker-compose when that CLI has no compose plugin), DOCKER_BUILDKIT=1,
#    COMPOSE_DOCKER_CLI_BUILD=1, WAFL_IMAGE, WAFL_BASE_IMAGE and WAFL_TORCH_VARIANT exported, so
#    that `docker compose`/`docker-compose` use the images just built.
# 6. Stops the engine when it exits, however it exits (its containers stop with it).
#
# Exit status: COMMAND's; 77 when the engine cannot be had here (not root, no apt-get, a package
# that does not install, a dockerd that does not start), with the reason on stderr; 1 otherwise.
set -euo pipefail

prog=local-engine
say() { printf '%s: %s\n' "$prog" "$*" >&2; }
unavailable() { say "unavailable: $*"; exit 77; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

case "${1:-}" in
    -h | --help) usage; exit 0 ;;
esac

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
engine_dir=${WAFL_ENGINE_DIR:-/var/cache/wafl/engine}
run_dir=${WAFL_ENGINE_RUN:-/run/wafl-engine}
variant=${WAFL_TORCH_VARIANT:-pypi}
image=${WAFL_IMAGE:-wafl:$variant}
base_tag=wafl-base:bookworm
base_packages=python3,python3-venv,iproute2,tini,ca-certificates
# What the base image is made from; its hash labels the image, and a change rebuilds it.
base_recipe="debootstrap --variant=minbase --include=$base_packages bookworm; no apt lists or .debs; LANG=C.UTF-8"

[ "$(id -u)" -eq 0 ] || unavailable "needs root (it installs packages and runs dockerd); run it with sudo"
[ "$(uname -s)" = Linux ] || unavailable "needs Linux"

mkdir -p "$engine_dir"
exec 9>"$engine_dir/lock"
if ! flock -n 9; then
    say "waiting for another run of this script (lock $engine_dir/lock)"
    flock -w 3600 9 || unavailable "another run of this script held $engine_dir/lock for an hour"
fi

# ------------------------------------------------------------------ 1. packages

install_packages() {
    local missing=()
    command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
    command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
    if [ -z "${WAFL_BASE_IMAGE:-}" ] && ! command -v debootstrap >/dev/null 2>&1; then
        missing+=(debootstrap)
    fi
    [ ${#missing[@]} -gt 0 ] || return 0
    command -v apt-get >/dev/null 2>&1 \
        || unavailable "missing ${missing[*]} and no apt-get to install them; install dockerd, docker-compose and debootstrap"
    say "installing ${missing[*]}"
    local guard=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then  # no service may start while the packages install
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        guard=/usr/sbin/policy-rc.d
    fi
    local ok=1
    { DEBIAN_FRONTEND=noninteractive apt-get update -q \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
        >"$engine_dir/apt.log" 2>&1 || ok=0
    [ -z "$guard" ] || rm -f "$guard"
    [ "$ok" = 1 ] || { tail -n 20 "$engine_dir/apt.log" >&2; unavailable "apt-get could not install ${missing[*]} (log: $engine_dir/apt.log)"; }
    if [[ " ${missing[*]} " == *" docker.io "* ]] && [ -d /run/systemd/system ]; then
        # the package enables the system's engine (with its bridge and firewall rules): not wanted here
        systemctl disable --now docker.socket docker.service >/dev/null 2>&1 || true
        say "the system's docker.service and docker.socket that docker.io enabled are disabled again"
    fi
}
install_packages

cli=docker
[ -x /usr/bin/docker ] && cli=/usr/bin/docker  # the CLI packaged with the engine, whatever else is on PATH
command -v "$cli" >/dev/null 2>&1 || unavailable "no docker CLI next to dockerd"

# ------------------------------------------------------------------ 2. the engine

sock="$run_dir/docker.sock"
pidfile="$run_dir/dockerd.pid"
export DOCKER_HOST="unix://$sock"
server_pid=""

stop_engine() {
    local pid
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ]; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 90); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 1
        done
        if kill -0 "$pid" 2>/dev/null; then
            say "dockerd $pid did not stop in 90 s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    # anything the engine left mounted under its folders (after a kill), then its runtime folder
    awk -v a="$run_dir/" -v b="$engine_dir/" 'index($2, a) == 1 || index($2, b) == 1 { print $2 }' /proc/mounts \
        | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    rm -rf --one-file-system "$run_dir"
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM HUP
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
    if [ -e "$pidfile" ] || [ -d "$run_dir" ]; then
        stop_engine
        say "engine stopped"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

[ ! -e "$pidfile" ] || { say "stopping an engine left by an earlier run"; stop_engine; }
mkdir -p "$run_dir/exec" "$run_dir/bin" "$engine_dir/data"
chmod 0700 "$run_dir"
# the engine's CLI first on PATH; `docker compose` runs docker-compose where the CLI has no compose plugin
cli=$(command -v "$cli")
if "$cli" compose version >/dev/null 2>&1; then
    ln -sf "$cli" "$run_dir/bin/docker"
else
    printf '#!/bin/sh\nif [ "$1" = compose ]; then shift; exec docker-compose "$@"; fi\nexec %s "$@"\n' "$cli" >"$run_dir/bin/docker"
    chmod 0755 "$run_dir/bin/docker"
fi
export PATH="$run_dir/bin:$PATH" DOCKER_BUILDKIT=1 COMPOSE_DOCKER_CLI_BUILD=1

say "starting dockerd (data root $engine_dir/data, socket $sock)"
setsid dockerd \
    --data-root "$engine_dir/data" \
    --exec-root "$run_dir/exec" \
    --host "$DOCKER_HOST" \
    --pidfile "$pidfile" \
    --containerd-namespace wafl-engine \
    --containerd-plugins-namespace wafl-engine-plugins \
    --bridge=none --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
    </dev/null >"$engine_dir/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 1 120); do
    docker version >/dev/null 2>&1 && break
    if ! kill -0 "$dockerd_pid" 2>/dev/null; then
        tail -n 20 "$engine_dir/dockerd.log" >&2
        unavailable "dockerd exited at start (log: $engine_dir/dockerd.log)"
    fi
    sleep 0.5
done
docker version >/dev/null 2>&1 || unavailable "dockerd did not answer within 60 s (log: $engine_dir/dockerd.log)"
driver=$(docker info --format '{{.Driver}}')
[ "$driver" != vfs ] || say "warning: storage driver vfs (no overlay on $engine_dir): images take several times their size"

# ------------------------------------------------------------------ 3. the base image

build_base() {
    local key mirror tmp start
    key=$(printf '%s' "$base_recipe" | sha256sum | cut -c1-16)
    if [ "$(docker image inspect --format '{{index .Config.Labels "wafl.base-recipe"}}' "$base_tag" 2>/dev/null)" = "$key" ]; then
        say "base image $base_tag: reused"
        return
    fi
    mirror=${WAFL_DEBIAN_MIRROR:-$(apt-get indextargets --format '$(SITE)' 'Identifier: Packages' 'Origin: Debian' \
        'Codename: bookworm' 2>/dev/null | grep -v security | head -n 1 || true)}
    mirror=${mirror:-http://deb.debian.org/debian}
    say "base image $base_tag: debootstrap bookworm from $mirror"
    start=$SECONDS
    tmp=$(mktemp -d "$engine_dir/rootfs.XXXXXX")
    if ! debootstrap --variant=minbase --include="$base_packages" bookworm "$tmp/rootfs" "$mirror" \
        >"$engine_dir/debootstrap.log" 2>&1; then
        tail -n 20 "$engine_dir/debootstrap.log" >&2
        awk -v a="$tmp/" 'index($2, a) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r umount -l
        rm -rf --one-file-system "$tmp"
        say "debootstrap failed (log: $engine_dir/debootstrap.log)"
        return 1
    fi
    awk -v a="$tmp/" 'index($2, a) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r umount -l
    rm -rf "$tmp/rootfs/var/cache/apt/archives/"*.deb "$tmp/rootfs/var/cache/apt/"*.bin "$tmp/rootfs/var/lib/apt/lists/"*
    tar --numeric-owner -C "$tmp/rootfs" -c . \
        | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' -c "LABEL wafl.base-recipe=$key" - "$base_tag" >/dev/null
    rm -rf --one-file-system "$tmp"
    say "base image $base_tag: made in $((SECONDS - start)) s"
}

if [ -n "${WAFL_BASE_IMAGE:-}" ]; then
    docker image inspect "$WAFL_BASE_IMAGE" >/dev/null 2>&1 \
        || { say "WAFL_BASE_IMAGE=$WAFL_BASE_IMAGE is not in this engine (docker load it first)"; exit 1; }
    base=$WAFL_BASE_IMAGE
else
    build_base
    base=$base_tag
fi

# ------------------------------------------------------------------ 4. the wafl image

pip_dir="$run_dir/pip"
python3 "$repo/scripts/pip-settings.py" serve "$pip_dir" 2>"$engine_dir/pip-settings.log" &
server_pid=$!
for _ in $(seq 1 100); do
    [ -e "$pip_dir/ready" ] && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$engine_dir/pip-settings.log" >&2; say "scripts/pip-settings.py failed"; exit 1; }
    sleep 0.1
done
[ -e "$pip_dir/ready" ] || { say "scripts/pip-settings.py did not start"; exit 1; }
secrets=(--secret "id=pip.conf,src=$pip_dir/pip.conf")
[ ! -f "$pip_dir/pip-cert" ] || secrets+=(--secret "id=pip-cert,src=$pip_dir/pip-cert")

say "image $image: building (TORCH_VARIANT=$variant, BASE_IMAGE=$base; log: $engine_dir/build.log)"
start=$SECONDS
if ! docker build --network host "${secrets[@]}" \
    --build-arg "BASE_IMAGE=$base" --build-arg "TORCH_VARIANT=$variant" \
    -f "$repo/docker/Dockerfile" -t "$image" "$repo" >"$engine_dir/build.log" 2>&1; then
    tail -n 40 "$engine_dir/build.log" >&2
    say "image $image: build failed (log: $engine_dir/build.log)"
    exit 1
fi
kill "$server_pid" 2>/dev/null || true
wait "$server_pid" 2>/dev/null || true
server_pid=""
elapsed=$((SECONDS - start))
cached=$(grep -c ' CACHED$' "$engine_dir/build.log" || true)
size=$(docker image inspect --format '{{.Size}}' "$image")
say "image $image: $(awk -v s="$size" 'BEGIN { printf "%.2f GB", s / 1e9 }') ($size bytes), built in $elapsed s ($cached steps cached)"
# earlier builds' untagged images, and the build cache beyond 20 GB (an old dependency layer), go
docker image prune -f >/dev/null 2>&1 || true
docker builder prune -f --keep-storage 20GB >/dev/null 2>&1 || true

# ------------------------------------------------------------------ 5. the command

export WAFL_IMAGE="$image" WAFL_BASE_IMAGE="$base" WAFL_TORCH_VARIANT="$variant"
[ $# -gt 0 ] || exit 0
say "running $* (DOCKER_HOST=$DOCKER_HOST)"
set +e
"$@"
rc=$?
set -e
exit "$rc"
