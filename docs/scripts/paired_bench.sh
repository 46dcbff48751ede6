#!/usr/bin/env bash
# The benchmark of two checkouts alternately, N pairs per setting (ZeRO-2, ZeRO-3, FSDP2), each run's JSON
# in OUT; docs/benchmarks.md quotes rank 0's medians and the median of the paired ratios. Run from any
# directory with a Python that has collgrad's dependencies:
#   N=5 OUT=/tmp/pairs bash docs/scripts/paired_bench.sh /path/to/old/checkout /path/to/new/checkout
set -u
OLD=$1 NEW=$2
N=${N:-5} OUT=${OUT:-/tmp/pairs} PY=${PY:-python}
M=${METHODS:-collgrad_all_gather,collgrad_iter,collgrad_fp32,collgrad_save,collgrad_load,collgrad_training_save,collgrad_training_load}
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
if compgen -G "$OUT/*.json" > /dev/null; then  # the summary reads every run in OUT: earlier ones would count
  echo "paired_bench: $OUT holds earlier runs; give OUT a fresh directory" >&2
  exit 2
fi
mkdir -p "$OUT"
for cfg in "s2:--stage 2" "s3:--stage 3" "f2:--source fsdp2"; do
  tag=${cfg%%:*} args=${cfg#*:}
  for i in $(seq 1 "$N"); do
    for side in old new; do
      if [ $side = old ]; then tree=$OLD; else tree=$NEW; fi
      # shellcheck disable=SC2086
      (cd /tmp && PYTHONPATH=$tree $PY -m collgrad bench $args ${BENCH_ARGS:-} --methods "$M" \
        --json "$OUT/$tag-$side-$i.json" > "$OUT/$tag-$side-$i.log" 2>&1)
    done
  done
done
$PY - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
for tag in ("s2", "s3", "f2"):
    rows = {}
    for side in ("old", "new"):
        for f in sorted(glob.glob(f"{out}/{tag}-{side}-*.json")):
            for m, v in json.load(open(f))["methods"].items():
                rows.setdefault(m, {}).setdefault(side, []).append(v["median_ms"])
    for m, v in rows.items():
        ratios = [b / a for a, b in zip(v.get("old", []), v.get("new", []))]
        if ratios:
            print(f"{tag} {m:26s} old {statistics.median(v['old']):7.1f}  new {statistics.median(v['new']):7.1f}"
                  f"  paired ratio {statistics.median(ratios):.2f}")
PY
