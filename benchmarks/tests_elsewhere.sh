#!/usr/bin/env bash
# The test suite on another machine (tests that hold on any machine): a fresh venv on
# the machine's own Python and torch (system site packages), deqbench's other dependencies from
# the wheels in .whl/ (carry .whl), the package installed editable, then
#   1. pytest -m "not gpu" with the GPU hidden (the machine's CPU, as CI runs it), in parallel
#      (pytest-xdist from .whl/ when present); failures are re-run serially to tell a
#      machine-dependent test from a parallel-run artefact;
#   2. pytest -m gpu on the GPU, when there is one.
#   OUT=/some/dir bash benchmarks/tests_elsewhere.sh
# CPU_TESTS / GPU_TESTS: the test paths of each part (default: tests); WORKERS: xdist workers.
set -u
OUT=${OUT:-/tmp/tests_elsewhere}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
VENV=$(mktemp -d)/venv
python3 -m venv --system-site-packages "$VENV"
PY=$VENV/bin/python
# the machine's python3 may itself be a venv (torch in its site-packages, not the system's):
# the new venv sees those packages through a .pth file
PARENT=$(python3 -c "import site; print(site.getsitepackages()[0])")
echo "$PARENT" > "$("$PY" -c "import site; print(site.getsitepackages()[0])")/_machine_packages.pth"
"$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl > "$OUT/install.log" 2>&1
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 \
  || echo "editable install failed: PYTHONPATH fallback" | tee -a "$OUT/install.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, platform; print('torch', torch.__version__, 'python', platform.python_version(), 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee "$OUT/machine.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/machine.txt"
N=${WORKERS:-8}
XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n $N"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES="" timeout ${CPU_TIMEOUT:-420} "$PY" -m pytest -q -m "not gpu" $XDIST \
  -p no:cacheprovider -o junit_family=xunit1 --junitxml="$OUT/cpu.xml" ${CPU_TESTS:-tests} > "$OUT/cpu.log" 2>&1
echo "cpu tests exit $? in $(($(date +%s) - t0)) s ($XDIST)" | tee -a "$OUT/machine.txt"
tail -n 3 "$OUT/cpu.log" | tee -a "$OUT/machine.txt"
FAILED=$(grep -E "^(FAILED|ERROR) tests/" "$OUT/cpu.log" | awk '{print $2}' | sort -u)
if [[ -n $FAILED ]]; then
  echo "re-running $(echo "$FAILED" | wc -l) failed tests serially" | tee -a "$OUT/machine.txt"
  CUDA_VISIBLE_DEVICES="" timeout ${RERUN_TIMEOUT:-120} "$PY" -m pytest -q -p no:cacheprovider $FAILED \
    > "$OUT/cpu_rerun.log" 2>&1
  echo "serial re-run exit $?" | tee -a "$OUT/machine.txt"
  tail -n 15 "$OUT/cpu_rerun.log" | tee -a "$OUT/machine.txt"
fi
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  t0=$(date +%s)
  timeout ${GPU_TIMEOUT:-480} "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs ${GPU_TESTS:-tests} > "$OUT/gpu.log" 2>&1
  echo "gpu tests exit $? in $(($(date +%s) - t0)) s" | tee -a "$OUT/machine.txt"
  tail -n 5 "$OUT/gpu.log" | tee -a "$OUT/machine.txt"
fi
