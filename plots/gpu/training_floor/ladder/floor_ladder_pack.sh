# The chunk ladder side by side, packed: the tree before (.carry/base, *_pow2*) against this tree (*_len16*), alternated; every json into one tarball.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r; F="--device cuda --capture --tf32 default --models pcdeq_sc"
run() { tag=$1; tree=$2; shift 2; T0=$(date +%s); python3 $tree/benchmarks/training_floor.py $F "$@" --json /tmp/r/$tag.json 2>&1 | grep -v Warning | tail -1; echo "== $tag $(( $(date +%s)-T0 ))s"; }
run sc_pack4_len16_a . --pack 4
run sc_pack4_pow2_a .carry/base --pack 4
run sc_pack4_len16_b . --pack 4
run sc_pack4_pow2_b .carry/base --pack 4
run sc_pack2_len16 . --pack 2
run sc_pack8_len16 . --pack 8
run sc_len16_3 .
nvidia-smi --query-gpu=name --format=csv,noheader
tar czf $OUT/floor_ladder_pack.tgz -C /tmp/r .
