#!/bin/bash
# KDA round 8 (device tool): main's prefill kernels (the checkout in $MAIN) beside this tree's front kernel + prep
# kernel configurations and FLA chunk_kda, at T = 8192, then the default and FLA at T = 32768.
# Usage: run_kda_round8.sh MAIN OUT
MAIN=$1; OUT=$2; HERE=$(cd "$(dirname "$0")/.." && pwd)
# block_v:num_warps:prep_warps:chunk:front_tokens:front_warps (the first: the default)
CFGS=${CFGS:-64:4:2:16:16:2,64:4:4:16:32:4,64:4:2:16:32:4,64:4:4:16:16:2,64:4:4:16:64:8,64:4:4:32:16:2}
main_bench() {  # T
    (cd "$MAIN" && PYTHONPATH=$PYTHONPATH:$MAIN timeout 40 python3 benchmarks/bench_kda.py --out "$OUT/main$1" \
        --no-compile --stages prefill --prefill-T "$1" --fla-prefill-T "" --chunk 64:4:4) > "$OUT/main$1.log" 2>&1
}
main_bench 8192
cd "$HERE" && timeout 200 python3 benchmarks/bench_kda.py --out "$OUT/new" --no-compile --decode "" --decode-bf16 "" \
    --decode-conv f32 --stages check,prefill --prefill-T 8192 --fla-prefill-T 8192 --chunk "$CFGS" > "$OUT/new.log" 2>&1
timeout 90 python3 benchmarks/bench_kda.py --out "$OUT/new32k" --no-compile --stages prefill --prefill-T 32768 \
    --fla-prefill-T 32768 --profile-T 32768 --chunk "${CFGS%%,*}" > "$OUT/new32k.log" 2>&1
main_bench 32768
rm -f "$OUT"/*/kda_bench.md
