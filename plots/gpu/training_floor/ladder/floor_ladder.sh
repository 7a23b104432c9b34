# The chunk ladder side by side: the tree of the commit before (.carry/base, powers-of-two chunks, files *_pow2*) against this tree (every length to 16, files *_len16*), alternated,
# on pcdeq_sc alone and packed 4; then every model of the floor table on this tree.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit,power.max_limit,memory.total,driver_version --format=csv | tee $OUT/gpu.csv
nproc; python3 -c "import torch;print(torch.__version__)"
F="--device cuda --capture --tf32 default"
run() { tag=$1; tree=$2; shift 2; T0=$(date +%s); python3 $tree/benchmarks/training_floor.py $F "$@" --json $OUT/$tag.json 2>&1 | grep -v Warning | tail -4; echo "== $tag $(( $(date +%s)-T0 ))s"; }
run sc_pow2_1 .carry/base --models pcdeq_sc
run sc_len16_1 . --models pcdeq_sc
run sc_pack4_pow2 .carry/base --models pcdeq_sc --pack 4
run sc_pack4_len16 . --models pcdeq_sc --pack 4
run sc_pow2_2 .carry/base --models pcdeq_sc
run sc_len16_2 . --models pcdeq_sc
run all_len16 . --models pcdeq_l fc_deq conv_deq
run all_pow2 .carry/base --models pcdeq_l fc_deq
run mc_len16 . --models pcdeq_mc --steps 40 --warmup 8
run mc_pow2 .carry/base --models pcdeq_mc --steps 40 --warmup 8
ls $OUT
