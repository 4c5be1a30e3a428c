#!/usr/bin/env bash
# Long fuzzing run of every libFuzzer target (native/fuzz/), all at once at low priority.
#
#   tools/fuzz_long.sh [SECONDS_PER_TARGET]      (default 3000; run it in the background)
#
# Builds the targets (clang, COLIBRI_FUZZ=ON: ASan + UBSan) in build/fuzz, copies the committed
# seed corpus of each target to build/fuzz-long/corpus/<target> (the run grows that copy, never
# the committed one), and runs each target for SECONDS_PER_TARGET with -print_final_stats=1.
# Logs: build/fuzz-long/<target>.log; crashes: build/fuzz-long/artifacts/<target>/.
# Summary (executions, coverage, crashes per target): build/fuzz-long/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${1:-3000}"
OUT=build/fuzz-long
CC=clang cmake -S native -B build/fuzz -DCOLIBRI_FUZZ=ON -DCOLIBRI_BUILD_TESTS=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/fuzz -j2 >/dev/null
mkdir -p "$OUT"
TARGETS=(fuzz_gguf fuzz_tokenizer fuzz_profile fuzz_replay fuzz_sampler)
for t in "${TARGETS[@]}"; do
  mkdir -p "$OUT/corpus/$t" "$OUT/artifacts/$t"
  cp -n native/fuzz/corpus/"$t"/* "$OUT/corpus/$t/" 2>/dev/null || true
  nice -n 19 "build/fuzz/$t" -max_total_time="$SECS" -print_final_stats=1 -rss_limit_mb=1500 \
    -artifact_prefix="$OUT/artifacts/$t/" "$OUT/corpus/$t" >"$OUT/$t.log" 2>&1 &
done
wait || true
{
  total=0
  for t in "${TARGETS[@]}"; do
    n=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$OUT/$t.log" | tail -1 | awk '{print $2}')
    cov=$(grep -E '^#[0-9]+ +DONE' "$OUT/$t.log" | tail -1 | grep -o 'cov: [0-9]* ft: [0-9]*' || true)
    crashes=$(find "$OUT/artifacts/$t" -type f | wc -l)
    echo "$t executions=${n:-0} ${cov} corpus=$(ls "$OUT/corpus/$t" | wc -l) crashes=$crashes"
    total=$((total + ${n:-0}))
  done
  echo "total executions=$total"
} | tee "$OUT/summary.txt"
