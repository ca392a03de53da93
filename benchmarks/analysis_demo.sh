#!/usr/bin/env bash
# The digits demonstrations of `wafl analyze` (NOT the issue's Fashion-MNIST tables): figures and JSON in
# benchmarks/results/analysis/digits-demo/ (only these summaries are committed, not the runs). Run the sweeps
# first (each writes its runs under runs/, the file's `out`):
#   wafl sweep configs/sweeps/asd_digits_dissimilarity.toml
#   wafl sweep configs/sweeps/scd_digits_sensitivity.toml
#   wafl sweep configs/sweeps/asd_digits_flatness.toml            (checkpoints: the flatness table)
#   wafl table runs/sweep-asd_digits_flatness --baseline fedavg --json $OUT/asd_digits_flatness_accuracy.json
#   wafl analyze flatness runs/sweep-asd_digits_flatness --samples 128 --probes 10 --max-iter 20 \
#       --json $OUT/flatness.json     (and flatness.md: its table)
#   wafl analyze flatness "runs/sweep-asd_digits_flatness/algorithm=fedavg+asd,seed=0" --samples 128 --probes 10 \
#       --max-iter 20 --density $OUT/density_fedavg+asd_seed0.png --lanczos-steps 40 \
#       --json $OUT/density_fedavg+asd_seed0.json         (the same for algorithm=fedavg,seed=0)
# then run this script (RUNS: the folder holding the sweeps' folders, default runs; OUT: where the figures go).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/analysis/digits-demo}
WAFL=${WAFL:-wafl}
RUNS=${RUNS:-runs}
G=$RUNS/sweep-asd_digits_dissimilarity
S=$RUNS/sweep-scd_digits_sensitivity
$WAFL analyze curves "$G" --metrics grad_dissimilarity,gm_accuracy --by params.asd_lambda \
  --title "digits demonstration (8 rounds, 1 seed): G_d against rounds, fedavg+asd (lambda 0 = FedAvg)" \
  --out "$OUT/gd_rounds.png" --json "$OUT/gd_rounds.json"
$WAFL analyze curves "$G" --metrics grad_dissimilarity --by params.asd_lambda --against params.asd_lambda \
  --title "digits demonstration (8 rounds, 1 seed): G_d (mean over rounds) against ASD lambda" \
  --out "$OUT/gd_lambda.png" --json "$OUT/gd_lambda.json"
for p in tau lambda_p lambda_g; do
  case $p in
    tau) where=(--where params.lambda_p=0.4 --where params.lambda_g=0.3) ;;
    lambda_p) where=(--where params.tau=0.4 --where params.lambda_g=0.3) ;;
    lambda_g) where=(--where params.tau=0.4 --where params.lambda_p=0.4) ;;
  esac
  $WAFL analyze curves "$S" "${where[@]}" --by "params.$p" --metrics gm_accuracy,pm_accuracy \
    --title "digits demonstration (5 rounds, 1 seed): SCD $p" --out "$OUT/scd_$p.png" --json "$OUT/scd_$p.json"
done
