#!/usr/bin/env bash
# Dask scaling with the defaults on one GPU host: `deqbench run suites/kglm_denoise_gpu.yaml` inline on GPU 0, then on
# the local Dask cluster over every GPU, with the defaults (`--set deterministic=true` so that the
# rows can be compared at rtol 0), one run each, then the report (ratio, breakdowns, Amdahl bound,
# rows compared).
#
#   benchmarks/dask_scaling_gpu.sh SEEDS OUT        e.g. benchmarks/dask_scaling_gpu.sh 0-2 /tmp/sweep78
#
# Each run compiles from cold (its own TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR), so the second
# run does not reuse the first one's kernels; matplotlib's font cache is built first, once per
# machine (it would fall on the first run only). PYTHON (default python3) runs everything.
set -euo pipefail
seeds=$1
out=$2
py=${PYTHON:-python3}
suite=suites/kglm_denoise_gpu.yaml
mkdir -p "$out"
$py -c "import matplotlib.font_manager"
n=$(nvidia-smi -L | wc -l)
for ex in inline dask; do
  TRITON_CACHE_DIR=$(mktemp -d)
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  export TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR
  if [ "$ex" = inline ]; then vis=0; else vis=$(seq -s, 0 $((n - 1))); fi
  CUDA_VISIBLE_DEVICES=$vis $py benchmarks/dask_scaling.py time $suite --executor "$ex" \
    --out "/tmp/dask_scaling_$seeds" --json "$out/$ex.json" -- --seeds "$seeds" \
    --set deterministic=true > "$out/$ex.log" 2>&1 || true
done
$py benchmarks/dask_scaling.py report "$out/inline.json" "$out/dask.json" --rtol 0 | tee "$out/report.txt"
