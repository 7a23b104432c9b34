# A calibration slice of the paper pcDEQ suite's SC grid as the suite runs it (evaluations included):
# the four SC pcDEQ cells, seed 0, 5,040 steps each (80 epochs of mnist5k), inline on one GPU.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 DEQBENCH_SOURCE_COMMIT=$1
T0=$(date +%s)
python3 -m deqbench run suites/paper/pcdeq.yaml --set 'select=pcdeq_sc-activation=relu6,pcdeq_sc-activation=tanh,pcdeq_sc-activation=softsign,pcdeq_sc-activation=sigmoid' --seeds 0 --set defaults.train.max_steps=5040 --out /tmp/cal --no-progress --no-plots 2>&1 | grep -v "^\s*$" | tail -15
echo "== rc ${PIPESTATUS[0]} wall $(( $(date +%s)-T0 ))s"
nvidia-smi --query-gpu=name --format=csv,noheader
R=$(ls -d /tmp/cal/pcdeq_paper/* | tail -1); ls $R
tar czf $OUT/sc_suite_slice.tgz -C $(dirname $R) $(basename $R)
