#!/bin/bash
# KDA round 7 (device tool): main's prefill kernels (the checkout in $MAIN) beside this tree's, FLA chunk_kda, at
# T = 8192 and 32768; the 32768 rows for the fastest prep configuration at 8192. Usage: run_kda_round7.sh MAIN OUT
MAIN=$1; OUT=$2; HERE=$(cd "$(dirname "$0")/.." && pwd)
CFGS="64:4:8:16:4:32,64:4:4:16:2:32,64:4:8:16:4:32:1,64:4:4:16:1:16:2"
(cd "$MAIN" && PYTHONPATH=$PYTHONPATH:$MAIN timeout 30 python3 benchmarks/bench_kda.py --out "$OUT/main" --no-compile \
    --stages prefill --prefill-T 8192,32768 --fla-prefill-T "" --chunk 64:4:4) > "$OUT/main.log" 2>&1
cd "$HERE" && timeout 85 python3 benchmarks/bench_kda.py --out "$OUT/new" --no-compile --decode "" --decode-bf16 "" \
    --decode-conv f32 --stages check,prefill --prefill-T 8192 --fla-prefill-T 8192 --chunk "$CFGS" > "$OUT/new.log" 2>&1
BEST=$(python3 - "$OUT/new.log" <<'PY'
import ast, re, sys
rows = [ast.literal_eval(l[4:]) for l in open(sys.argv[1]) if l.startswith("ROW ")]
rows = [r for r in rows if r["impl"].startswith("k3c")]
best = min(rows, key=lambda r: r["ms"])["impl"]
pw, sub, bk, form = re.search(r"prep (\d+) warps, (\d+) chunks per program, (\d+)-channel slices, form (\d)",
                              best).groups()
print(f"64:4:{pw}:16:{sub}:{bk}:{form}")
PY
)
echo "best at 8192: $BEST" >> "$OUT/new.log"
timeout 40 python3 benchmarks/bench_kda.py --out "$OUT/new32k" --no-compile --stages prefill --prefill-T 32768 \
    --fla-prefill-T 32768 --chunk "${BEST:-64:4:4:16:4:32}" > "$OUT/new32k.log" 2>&1
rm -f "$OUT"/*/kda_bench.md
