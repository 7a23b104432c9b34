#!/usr/bin/env bash
# The GPU runs behind README.md "Benchmarks" (plots/gpu/), in the layout they were run in: a host
# with two GPUs, timed work alone on its GPU, untimed suites packed as Dask workers on the other.
# Needs `pip install -e '.[dask]'` (and examples/deqbench-torchdeq for the TorchDEQ tables of
# benchmarks/vs_torchdeq.py, not run here). Results go to $OUT (default results/gpu).
#
#   bash benchmarks/reproduce_gpu.sh            # everything, about 45 GPU-minutes on two H200s
#   bash benchmarks/reproduce_gpu.sh landscape  # one part: landscape | families | scaling | suites
#
# Every `deqbench run` can be cut and continued with `--resume RUN_DIR`.
set -euo pipefail
OUT=${OUT:-results/gpu}
PART=${1:-all}
mkdir -p "$OUT"
run() { python -m deqbench run "$@" --no-progress; }

if [[ $PART == all || $PART == landscape ]]; then
  # 51x51 landscape vs its floor: 4 shards of interleaved rows, two per GPU, then merged
  (for k in 0 1; do CUDA_VISIBLE_DEVICES=0 python benchmarks/landscape.py --shard $k/4 --floor-every 2 --json "$OUT/landscape_shard$k.json"; done) &
  (for k in 2 3; do CUDA_VISIBLE_DEVICES=1 python benchmarks/landscape.py --shard $k/4 --floor-every 2 --json "$OUT/landscape_shard$k.json"; done) &
  wait
  python benchmarks/landscape.py --merge "$OUT"/landscape_shard{0,1,2,3}.json --json "$OUT/landscape_merged.json"
fi

if [[ $PART == all || $PART == families ]]; then
  # GPU 1: timed suites, one after the other; GPU 0: pcDEQ as 4 Dask workers, then monDEQ fc
  (CUDA_VISIBLE_DEVICES=1 run suites/backward.yaml --device cuda --set defaults.train.epochs=10 --out "$OUT/backward"
   CUDA_VISIBLE_DEVICES=1 run suites/opteq_gpu.yaml --out "$OUT/opteq") &
  (CUDA_VISIBLE_DEVICES=0 run suites/pcdeq_gpu.yaml --executor dask --workers 4 --out "$OUT/pcdeq"
   CUDA_VISIBLE_DEVICES=0 run suites/mondeq_gpu.yaml --out "$OUT/mondeq") &
  wait
fi

if [[ $PART == all || $PART == scaling ]]; then
  # Dask scaling: the kGLM denoising grid inline on one GPU, then the local cluster on both
  CUDA_VISIBLE_DEVICES=0 python benchmarks/dask_scaling.py time suites/kglm_denoise_gpu.yaml \
    --executor inline --out "$OUT/scale" --json "$OUT/scale_inline.json"
  python benchmarks/dask_scaling.py time suites/kglm_denoise_gpu.yaml \
    --executor dask --out "$OUT/scale" --json "$OUT/scale_dask.json"
  python benchmarks/dask_scaling.py report "$OUT/scale_inline.json" "$OUT/scale_dask.json" \
    --json "$OUT/scale_report.json" | tee "$OUT/scale_report.md"
fi

if [[ $PART == all || $PART == suites ]]; then
  # untimed analysis suites, each cell a Dask task on one GPU
  CUDA_VISIBLE_DEVICES=0 run suites/landscape.yaml --device cuda --executor dask --workers 4 --out "$OUT/landscape" &
  CUDA_VISIBLE_DEVICES=1 run suites/hessian.yaml --device cuda --executor dask --workers 4 --out "$OUT/hessian" &
  wait
fi
