#!/usr/bin/env bash
# The committed smoke run (plots/smoke) against a fresh run on another machine: its CPU (the
# reference check CI makes, with this machine's torch and kernels) and its GPU (every solve
# counted and verified on the CUDA paths: captured graphs, adjoints in autograd's device threads).
#   OUT=/some/dir bash benchmarks/smoke_elsewhere.sh
set -u
OUT=${OUT:-/tmp/smoke_elsewhere}
mkdir -p "$OUT"
RUNS=$(mktemp -d)
export PYTHONUNBUFFERED=1 DEQBENCH_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c "import torch, platform; print('torch', torch.__version__, 'cpu', platform.processor() or platform.machine(), 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee "$OUT/machine.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/machine.txt"
python3 -m deqbench run suites/smoke.yaml --out "$RUNS/cpu" --no-progress > "$OUT/smoke_cpu.log" 2>&1
echo "cpu run exit $?" | tee -a "$OUT/machine.txt"
python3 -m deqbench compare plots/smoke "$RUNS"/cpu/smoke/* --reference > "$OUT/reference_cpu.txt" 2>&1
echo "reference check (cpu) exit $?" | tee -a "$OUT/machine.txt"
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  python3 -m deqbench run suites/smoke.yaml --device cuda --out "$RUNS/cuda" --no-progress > "$OUT/smoke_cuda.log" 2>&1
  echo "cuda run exit $?" | tee -a "$OUT/machine.txt"
  python3 - "$RUNS"/cuda/smoke/* >> "$OUT/machine.txt" <<'PY'
import sys
import deqbench
df = deqbench.load_results(sys.argv[1])
c = df[df.analysis == "convergence"]
print("cuda convergence rows by (metric, variant):")
print(c.groupby(["metric", "variant"]).value.agg(["count", "max"]).to_string())
ift = {i for i in df.cell_id.unique() if "-ift" in i}
got = set(c[(c.metric == "adjoint_unconverged_batches") & (c.variant == "train")].cell_id)
print("ift cells without adjoint rows:", sorted(ift - got))
PY
fi
