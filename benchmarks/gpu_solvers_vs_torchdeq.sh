#!/usr/bin/env bash
# The GPU solver, training-step and throughput rows against TorchDEQ plus the NTK target, on one
# GPU (H100), in one go, well under 8 minutes: the default-path (CUDA graph)
# solver rows, bf16 rows, the IFT training step and the throughput stage of
# benchmarks/vs_torchdeq.py (not its suites stage), then the NTK target case (N = 512, P ~ 100k)
# of benchmarks/ntk.py. Everything is written under DIR ($1, default $OUT, else
# results/gpu_solvers_vs_torchdeq) and packed at the end into DIR/gpu_solvers_vs_torchdeq.tgz, beside which stay summary.md,
# ntk.json, ntk.md and the two logs (6 files: the device machine returns at most 8).
#
#   bash benchmarks/gpu_solvers_vs_torchdeq.sh "$OUT"
#
# Python: $PYTHON, else python3, else python. deqbench runs from this checkout (PYTHONPATH).
# Missing packages are installed offline, only if missing: deqbench's dependencies from the
# wheels in .whl/ (carry .whl), TorchDEQ from $TORCHDEQ_WHEEL or .whl/torchdeq-*.whl; the
# TorchDEQ plugin is registered from examples/deqbench-torchdeq by vs_torchdeq.py itself.
# Without TorchDEQ the deqbench rows still run and summary.md says "TorchDEQ not installed".
# Each step has a time limit (VS_TIMEOUT, NTK_TIMEOUT seconds) so the packing always happens.
# VS_ARGS / NTK_ARGS are appended to the two commands (a CPU check of this script:
# VS_ARGS="--quick --device cpu" NTK_ARGS="--quick --device cpu" bash benchmarks/gpu_solvers_vs_torchdeq.sh /tmp/gpu_solvers_check).
set -o pipefail
export PYTHONUNBUFFERED=1
DIR=${1:-${OUT:-results/gpu_solvers_vs_torchdeq}}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
VS_TIMEOUT=${VS_TIMEOUT:-360}
NTK_TIMEOUT=${NTK_TIMEOUT:-120}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
t0=$(date +%s)

{
  echo "# setup $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv || true
  if ! "$PY" -c "import pydantic, deqbench.run.specs" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    echo "installing deqbench's dependencies from .whl/ into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  if ! "$PY" -c "import torchdeq" 2>/dev/null; then
    whl=${TORCHDEQ_WHEEL:-$(ls .whl/torchdeq-*.whl 2>/dev/null | head -n 1)}
    if [[ -n $whl && -f $whl ]]; then
      echo "installing TorchDEQ from $whl into /tmp/site_torchdeq"
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site_torchdeq "$whl" && export PYTHONPATH="$PYTHONPATH:/tmp/site_torchdeq"
    else
      echo "TorchDEQ not installed (no wheel: set TORCHDEQ_WHEEL or put it in .whl/)"
    fi
  fi
  "$PY" -c "import torch, deqbench; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'deqbench', deqbench.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
} >"$DIR/setup.log" 2>&1
# the exports made inside { } above apply here too (a group, not a subshell)
cat "$DIR/setup.log"

rc=0
timeout "$VS_TIMEOUT" "$PY" benchmarks/vs_torchdeq.py --out "$DIR/vs" \
  --stages solvers train_step throughput --amp ${VS_ARGS:-} 2>&1 | tee "$DIR/vs.log" || rc=$?
echo "[gpu_solvers_vs_torchdeq] vs_torchdeq exit $rc at $(($(date +%s) - t0)) s" | tee -a "$DIR/vs.log"

rc2=0
timeout "$NTK_TIMEOUT" "$PY" benchmarks/ntk.py --device cuda --quick-target \
  --out "$DIR/ntk.json" ${NTK_ARGS:-} 2>&1 | tee "$DIR/ntk.log" || rc2=$?
echo "[gpu_solvers_vs_torchdeq] ntk exit $rc2 at $(($(date +%s) - t0)) s" | tee -a "$DIR/ntk.log"

# pack: everything in one tarball; summary.md, ntk.json/.md and the logs stay beside it
mv "$DIR/setup.log" "$DIR/vs/setup.log" 2>/dev/null || true
if [[ -f $DIR/vs/summary.md ]]; then
  cp "$DIR/vs/summary.md" "$DIR/summary.md"
else
  echo "vs_torchdeq.py wrote no summary.md (exit $rc): see vs.log" >"$DIR/summary.md"
fi
tar -czf "$DIR/gpu_solvers_vs_torchdeq.tgz" -C "$DIR" $(cd "$DIR" && ls -d vs ntk.json ntk.md vs.log ntk.log 2>/dev/null) \
  && rm -rf "$DIR/vs"
echo "[gpu_solvers_vs_torchdeq] done in $(($(date +%s) - t0)) s: $(ls "$DIR" | tr '\n' ' ')"
# the targets, compactly (the tables are in summary.md)
echo "== targets; $(sed -n 3p "$DIR/summary.md" | cut -c1-200)"
grep -E '^(\*\*|Target|Failed|  - |- .*(met|n/a|x;|=))' "$DIR/summary.md" || true
grep -h "NTK target" "$DIR/ntk.log" || true
exit $((rc != 0 ? rc : rc2))
