#!/usr/bin/env bash
# One device call for the quantized decode GEMMs: GPU tests, op conformance (linear, grouped_linear,
# moe_experts; default and batch-invariant mode), then benchmarks/nvidia_qgemm.py (its table last).
#   WHL=.whl T_TESTS=80 T_CONF=45 T_BENCH=100 BENCH_ARGS="--quick --sweep" bash benchmarks/qgemm_h200.sh
set -u
OUT=${OUT:-$PWD/h200_out}
mkdir -p "$OUT"
export SHUILI_NVIDIA_QGEMM=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WHL=${WHL:-.whl}
if [ -d "$WHL" ]; then  # packages the device image lacks (pydantic), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  git -C .. rev-parse --short HEAD 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"
stamp tests
timeout ${T_TESTS:-80} python3 -m pytest -q -p no:cacheprovider -x ${TESTS:-tests/nvidia/test_qgemm.py} 2>&1 \
  | tee "$OUT/tests.txt" | tail -6
for mode in ${CONF_MODES:-default bi}; do
  stamp "conformance $mode"
  flag=""; [ "$mode" = bi ] && flag="--batch-invariant"
  timeout ${T_CONF:-45} python3 -m shuili -v conformance run --platform nvidia --no-engine $flag --cases ${CASES:-1} \
      --op linear --op grouped_linear --op moe_experts --out "$OUT/conf_$mode" > "$OUT/conf_$mode.txt" 2>&1
  echo "rc=$?" >> "$OUT/conf_$mode.txt"
  grep -E "conformance of|PASSED|FAILED|pass|^  (FAIL|ERROR)|rc=" "$OUT/conf_$mode.txt" | tail -6
done
stamp bench
timeout ${T_BENCH:-100} python3 benchmarks/nvidia_qgemm.py --json "$OUT/qgemm.json" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench.txt" | tail -90
stamp done
