# GPU session of 2026-11-26 (eighth): colocated RL on the H100, npu_pool's pause/resume against the
# stock offload/reload (benchmarks/gpu_colocate.py), two sizes of trainer, repeated.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch; print(torch.__version__)"; nproc) > $OUT/machine.txt 2>&1
c() {  # DIM LAYERS NAME
  timeout 170 python3 benchmarks/gpu_colocate.py --dim $1 --layers $2 --cycles 5 --json $OUT/$3.json > $OUT/$3.log 2>&1
  echo "== $3 exit $? at $(( SECONDS - T0 )) s"; cat $OUT/$3.log | grep -v "^\[W"
}
c 1024 8 coloc_1024_1
c 2048 8 coloc_2048_1
c 1024 8 coloc_1024_2
c 2048 8 coloc_2048_2
echo "== all done at $(( SECONDS - T0 )) s"
