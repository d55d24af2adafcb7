#!/usr/bin/env bash
# One device call on the H200: environment, GPU kernel tests, conformance, kernel roofline, end to end.
#   STAGES="env tests conf kernels e2e" bash benchmarks/run_h200.sh      (default: all)
# Logs and JSON go to $OUT (or ./h200_out); a short table is printed last.
set -u
OUT=${OUT:-$PWD/h200_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
STAGES=${STAGES:-"env tests conf kernels e2e"}
if [ -d .whl ]; then  # packages the device image lacks (pydantic), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
has() { [[ " $STAGES " == *" $1 "* ]]; }
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"; }

if has env; then
  stamp env
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
    python3 -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'DeepseekV4ForCausalLM', hasattr(transformers, 'DeepseekV4ForCausalLM'))"
  } 2>&1 | tee "$OUT/env.txt"
fi
if has tests; then
  stamp tests
  timeout ${T_TESTS:-240} python3 -m pytest -q -x -p no:cacheprovider tests/nvidia 2>&1 | tail -25 | tee "$OUT/tests.txt"
fi
if has conf; then
  stamp conformance-ops-default
  timeout ${T_CONF:-150} python3 -m shuili conformance run --platform nvidia --no-engine --cases ${CASES:-2} \
      --out "$OUT/conf_default" > "$OUT/conf_default.txt" 2>&1; echo "rc=$?" >> "$OUT/conf_default.txt"
  tail -30 "$OUT/conf_default.txt"
  stamp conformance-bi
  SHUILI_NVIDIA_BATCH_INVARIANT=1 timeout ${T_CONFBI:-240} python3 -m shuili conformance run --platform nvidia \
      ${CONF_BI_ARGS:---no-engine} --cases ${CASES:-2} --out "$OUT/conf_bi" > "$OUT/conf_bi.txt" 2>&1
  echo "rc=$?" >> "$OUT/conf_bi.txt"; tail -30 "$OUT/conf_bi.txt"
fi
if has confbi; then  # batch-invariant mode: the engine checks are held bitwise
  stamp conformance-bi-ops
  SHUILI_NVIDIA_BATCH_INVARIANT=1 timeout ${T_BIOPS:-150} python3 benchmarks/nvidia_conformance.py --no-engine \
      --cases ${CASES:-1} --json "$OUT/conf_bi_ops.json" > "$OUT/conf_bi_ops.txt" 2>&1
  grep -v "^ pass" "$OUT/conf_bi_ops.txt" | tail -25
  stamp conformance-bi-engine
  SHUILI_NVIDIA_BATCH_INVARIANT=1 timeout ${T_BIENG:-150} python3 benchmarks/nvidia_conformance.py --no-ops \
      --workload ${WORKLOAD:-tiny-v4} --json "$OUT/conf_bi_engine.json" > "$OUT/conf_bi_engine.txt" 2>&1
  tail -15 "$OUT/conf_bi_engine.txt"
fi
if has e2e; then
  stamp e2e
  timeout ${T_E2E:-400} python3 benchmarks/nvidia_e2e.py --json "$OUT/e2e.json" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.txt" | tail -30
fi
if has kernels; then
  stamp kernels
  timeout ${T_KERNELS:-240} python3 benchmarks/nvidia_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt" | tail -45
fi
stamp done
cat "$OUT/summary.txt"
