#!/usr/bin/env bash
# Makes sure the datasets a command needs are on this machine. Arguments: a `wafl run` command
# line (only `--dataset fashion-mnist` without `--data-dir` needs anything) or just `fashion-mnist`.
# Fashion-MNIST: when its four IDX files are not where Debian's dataset-fashion-mnist package puts
# them, installs that package if we are root and apt-get is there (running `apt-get update` once
# when the package is unknown); otherwise says how to get the files. Never fails the caller: a
# run without the files stops with a one-line error that names the missing file.
set -uo pipefail
dir=${WAFL_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}  # the override is for tests
files="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"

wants=0 own_dir=0 prev=""
for a in "$@"; do
  case "$a" in
    fashion-mnist) [ -z "$prev" ] || [ "$prev" = "--dataset" ] && wants=1 ;;
    --dataset=fashion-mnist) wants=1 ;;
    --data-dir | --data-dir=*) own_dir=1 ;;
  esac
  prev=$a
done
[ "$wants" = 1 ] && [ "$own_dir" = 0 ] || exit 0

present() {
  for f in $files; do [ -s "$dir/$f" ] || return 1; done
}
present && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-cache show dataset-fashion-mnist >/dev/null 2>&1; then
    echo "datasets: apt-get update (dataset-fashion-mnist is not in the package lists)" >&2
    apt-get update -qq >&2 || true
  fi
  echo "datasets: apt-get install dataset-fashion-mnist (Fashion-MNIST into $dir)" >&2
  apt-get install -y -qq dataset-fashion-mnist >&2 || true
  present && exit 0
fi
echo "datasets: Fashion-MNIST is not in $dir. Get it with 'apt-get install dataset-fashion-mnist' (Debian/Ubuntu," \
  "as root), or download the four IDX files ($files) from https://github.com/zalandoresearch/fashion-mnist" \
  "into a folder and pass --data-dir DIR." >&2
exit 0
