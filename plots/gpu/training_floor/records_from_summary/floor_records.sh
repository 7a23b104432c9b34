# Residual maxima from the read summary, side by side: the tree before (.carry/base, *_devread*) against this tree (*_summary*), alternated.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r; F="--device cuda --capture --tf32 default"
run() { tag=$1; tree=$2; shift 2; T0=$(date +%s); python3 $tree/benchmarks/training_floor.py $F "$@" --json /tmp/r/$tag.json 2>&1 | grep -E "^\| (pcdeq|fc)" ; echo "== $tag $(( $(date +%s)-T0 ))s"; }
run sc_devread_1 .carry/base --models pcdeq_sc
run sc_summary_1 . --models pcdeq_sc
run sc_devread_2 .carry/base --models pcdeq_sc
run sc_summary_2 . --models pcdeq_sc
run sc_pack4_devread .carry/base --models pcdeq_sc --pack 4
run sc_pack4_summary . --models pcdeq_sc --pack 4
run small_devread .carry/base --models pcdeq_l fc_deq
run small_summary . --models pcdeq_l fc_deq
run mc_devread .carry/base --models pcdeq_mc --steps 40 --warmup 8
run mc_summary . --models pcdeq_mc --steps 40 --warmup 8
nvidia-smi --query-gpu=name --format=csv,noheader
tar czf $OUT/floor_records.tgz -C /tmp/r .
