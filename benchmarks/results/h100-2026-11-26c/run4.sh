# GPU session of 2026-11-26 (eighth), fourth call: the build after the review (bound rounding 64,
# a lowered bound honoured at resume, a resume's one device lookup), as run3.sh.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
c() {  # DIM LAYERS NAME
  timeout 110 python3 benchmarks/gpu_colocate.py --dim $1 --layers $2 --cycles 5 --json $OUT/$3.json > /tmp/$3.log 2>&1
  echo "== $3 exit $? at $(( SECONDS - T0 )) s"; grep -v "^\[W" /tmp/$3.log
}
c 1024 8 call4_final_1024_1
c 2048 8 call4_final_2048_1
echo "== all done at $(( SECONDS - T0 )) s"
