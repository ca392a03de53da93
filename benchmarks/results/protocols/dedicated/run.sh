#!/bin/sh
# Wait-free vs compute-and-wait with a dedicated CPU share per host (--host-cpus auto: the
# machine's cores split evenly between the server and the 4 clients, 10 ms quota period), each
# client behind its own 20 Mbit/s link and the server behind one of 4 x 20 Mbit/s, SCD and
# Ditto, at the bench's default settings and at the README's settings, three repetitions each,
# one at a time. Earlier runs (100 ms period, a 20 Mbit/s server link): earlier-100ms-server-link-20mbit/;
# SCD before its faster CPU transform: earlier-torch-fft/.
# Usage: run.sh [WAFL]   (from the repository root; WAFL defaults to `wafl`)
set -eu
WAFL=${1:-wafl}
OUT=benchmarks/results/protocols/dedicated
README="--rounds 10 --set local_epochs=1 --set pm_epochs=2 --set batch_size=64"
for rep in 1 2 3; do
  for setting in defaults readme; do
    for alg in scd ditto; do
      extra=""
      [ "$setting" = readme ] && extra=$README
      dir=$OUT/$setting/$alg/rep$rep
      [ -f "$dir/protocols.json" ] && continue
      echo "== $(date +%T) $setting $alg rep$rep" >&2
      # shellcheck disable=SC2086
      "$WAFL" bench protocols --algorithm "$alg" --clients 4 --link-rate 20mbit --target 0.9 $extra --out "$dir" --quiet ||
        echo "== $setting $alg rep$rep: the bench exited with an error" >&2
    done
  done
done
# SCD at the bench's defaults on slower links: 5 Mbit/s per client (the server 4 x 5 Mbit/s), where
# communication is long against the GM phase, the case the wait-free protocol is made for.
for rep in 1 2 3; do
  dir=$OUT/slow-links/scd/rep$rep
  [ -f "$dir/protocols.json" ] && continue
  echo "== $(date +%T) slow-links scd rep$rep" >&2
  "$WAFL" bench protocols --algorithm scd --clients 4 --link-rate 5mbit --target 0.9 --out "$dir" --quiet ||
    echo "== slow-links scd rep$rep: the bench exited with an error" >&2
done
