#!/bin/bash
# KDA round 9 (device tool): chunked-prefill configurations (the first: the default) in one process, each checked
# against the reference first, then FLA chunk_kda at T = 8192 (its autotuning needs a minute or more), then the
# k3c configurations at T = 32768. The round's table came from this script at commit d5e4956, whose --chunk had a
# seventh field (O buffer dtype) and a two-block chunk-32 prep kernel, with
# CFGS=64:4:2:32:16:2:1,64:4:2:32:16:2:0,64:4:4:32:16:2:1,32:4:2:32:16:2:1,64:8:2:32:16:2:1,64:4:2:16:16:2:1,64:4:2:16:16:2:0
# Usage: run_kda_round9.sh OUT [SECONDS]
OUT=$1; HERE=$(cd "$(dirname "$0")/.." && pwd)
# block_v:num_warps:prep_warps:chunk:front_tokens:front_warps
CFGS=${CFGS:-64:4:2:16:16:2,64:4:2:32:16:2}
cd "$HERE" && timeout "${2:-290}" python3 benchmarks/bench_kda.py --out "$OUT/r9" --no-compile --decode "" \
    --decode-bf16 "" --decode-conv f32 --stages check,prefill --prefill-T 8192,32768 --fla-prefill-T 8192 \
    --profile-T 8192 --chunk "$CFGS" > "$OUT/r9.log" 2>&1
rm -f "$OUT"/*/kda_bench.md
