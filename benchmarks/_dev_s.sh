python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_lead/.whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 benchmarks/mx_ceiling.py --out $OUT/ceil --batches 16,1 --variants "wgmma,16,2,dec3;wgmma,16,2,dec3,noload;stream,32,256,2,3,dec3;linear" 2>&1 | grep -v Warning | tail -12
timeout 150 python3 benchmarks/mx_tma_probe.py --out $OUT/probe --experts 32 --batches 16,1 --variants "8,32,2,2,0,0,80,tb" 2>&1 | grep -v Warning | tail -4
