#!/bin/bash
# KDA round 7 (device tool): main's prefill kernels (the checkout in $MAIN) beside this tree's, FLA chunk_kda, at
# T = 8192 (and 32768 for the configuration in $T32K, when set). Usage: run_kda_round7.sh MAIN OUT
MAIN=$1; OUT=$2; HERE=$(cd "$(dirname "$0")/.." && pwd)
CFGS="64:4:8:16:4:32,64:4:4:16:1:16:2,64:4:8:16:4:32:1"
(cd "$MAIN" && PYTHONPATH=$PYTHONPATH:$MAIN timeout 22 python3 benchmarks/bench_kda.py --out "$OUT/main" --no-compile \
    --stages prefill --prefill-T 8192 --fla-prefill-T "" --chunk 64:4:4) > "$OUT/main.log" 2>&1
cd "$HERE" && timeout 75 python3 benchmarks/bench_kda.py --out "$OUT/new" --no-compile --decode "" --decode-bf16 "" \
    --decode-conv f32 --stages check,prefill --prefill-T 8192 --fla-prefill-T 8192 --chunk "$CFGS" > "$OUT/new.log" 2>&1
[ -n "$T32K" ] && timeout 40 python3 benchmarks/bench_kda.py --out "$OUT/new32k" --no-compile --stages prefill \
    --prefill-T 32768 --fla-prefill-T 32768 --chunk "$T32K" > "$OUT/new32k.log" 2>&1
rm -f "$OUT"/*/kda_bench.md
