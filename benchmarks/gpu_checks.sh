#!/usr/bin/env bash
# The GPU checks in one bounded run: every figure lands in OUTDIR, one file per check, and summary.txt says which
# ran, how long each took and which were skipped for time. GPU leases are short, so the checks run in order of
# value, each under its own timeout, and a check is skipped (not started) when the time left is less than it needs.
#
# Usage: bash benchmarks/gpu_checks.sh OUTDIR [BUDGET_S]      (default budget 540 s)
#   SKIP="name name" leaves those checks out (e.g. SKIP="small_build engine_small" once a lease has measured them).
#   PYTHON=python3 (default) must import tailspec as installed (a wheel or `pip install .`), not the source tree:
#   the component folders (rollout/, scheduler/, ...) install as tailspec.<component>, so everything here runs
#   with `python -P` (no current directory on sys.path) and pytest from outside the checkout.
# What it runs (BENCHMARKS.md, "On a GPU", has the figures of earlier leases):
#   1. pytest -m gpu (graph pool replay vs eager and pool size; NVML utilisation and the idle detector; a session
#      freeing its device memory before its last merge; the engine
#      with its pool against each request alone and HF generate; no cuDNN
#      attention in the engine's forward or a session's teacher)
#   2. benchmarks/attention_backends.py: the target's forward and a no-SD rollout under each SDPA setting
#   3. benchmarks/longtail_profile.py: a cold and a warm long tail at k = 0 and 3, the cold ones profiled
#   4. tailspec bench adaptive --device cuda (the main job's setting: the graph pool attached)
#   5. the `small` preset pre-trained on the GPU (cached under $TAILSPEC_CACHE), then its engine bench
#   6. tailspec bench adaptive --no-graphs (the eager comparison)
#   7. tailspec bench engine on the deep preset, bf16, batches 1, 8, 32, 128
set -uo pipefail
OUT=${1:?usage: gpu_checks.sh OUTDIR [BUDGET_S]}
BUDGET=${2:-540}
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# check NAME NEED_S CMD...: run CMD with at most 2 x NEED_S (and never past the budget); output to OUT/NAME.txt
check() {
  local name=$1 need=$2
  shift 2
  case " ${SKIP:-} " in *" $name "*) echo "SKIP $name (SKIP)" | tee -a "$OUT/summary.txt"; return ;; esac
  local l
  l=$(left)
  if [ "$l" -lt "$need" ]; then
    echo "SKIP $name (needs ${need} s, ${l} s left)" | tee -a "$OUT/summary.txt"
    return
  fi
  local limit=$((need * 2 < l ? need * 2 : l)) t
  LAST_RC=1
  t=$(date +%s)
  (cd /tmp && timeout "$limit" "$@") > "$OUT/$name.txt" 2>&1
  LAST_RC=$?
  echo "$name rc=$LAST_RC $(($(date +%s) - t)) s" | tee -a "$OUT/summary.txt"
}

TS=("$PY" -P -m tailspec.cli)  # an array, not a function: `timeout` runs programs only

{ nvidia-smi; nproc; "$PY" -P -c "import sys, torch, transformers, tailspec; print(sys.version); \
print('torch', torch.__version__, 'transformers', transformers.__version__, 'tailspec', tailspec.__file__); \
print(torch.cuda.get_device_properties(0))"; } > "$OUT/env.txt" 2>&1

check pytest_gpu 90 "$PY" -P -m pytest -q -p no:cacheprovider -m gpu -o addopts="" --rootdir=/tmp \
  "$REPO/tests/test_graph_pool.py" "$REPO/tests/test_scheduler_telemetry.py" "$REPO/tests/test_gpu_attention.py" \
  "$REPO/tests/test_gpu_engine.py" "$REPO/tests/test_session_release.py"
# the engine's attention kernel per setting (fifth lease: with cuDNN excluded, GQA fell back to the math kernel)
check attention 60 "$PY" -P "$REPO/benchmarks/attention_backends.py" "$OUT/attention.json"
# the one-time cost per new shape on the graph path (third lease): profile a cold long tail before anything else
check longtail_profile 90 "$PY" -P "$REPO/benchmarks/longtail_profile.py" "$OUT/longtail_profile"
check adaptive 150 "${TS[@]}" bench adaptive --json --device cuda
check small_build 120 "$PY" -P -c "import torch; torch.backends.cuda.matmul.allow_tf32 = True; \
from tailspec.tasks.policy import get_policy; print(get_policy('small', device='cuda', progress=False))"
# only with the GPU-trained policy: without it, resolving `small` would pre-train it on the host's CPU
[ "${LAST_RC:-1}" = 0 ] && check engine_small 90 "${TS[@]}" bench engine --json --device cuda --dtype bfloat16 --policy small --draft-policy micro \
  --drafters ngram,draft_model --batches 1,8,32,128 --ks 2,4,6 --repeats 2 --cost-repeats 1 --no-assisted
check adaptive_eager 150 "${TS[@]}" bench adaptive --json --device cuda --no-graphs
# the demo's bootstrap drafter for deep (cached; bench adaptive built it if it was missing)
check boot_drafter 30 "$PY" -P -c "from tailspec.core.config import TailspecConfig; \
from tailspec.demo.bootstrap import bootstrap_drafter; from tailspec.demo.options import DemoOptions, apply_demo_trainer; \
from tailspec.tasks.policy import resolve_policy; c = TailspecConfig(); d = c.model_copy(deep=True); \
apply_demo_trainer(d.trainer, DemoOptions.validation_samples); \
print(bootstrap_drafter(resolve_policy('deep', c.task, cache_dir=c.cache_dir), d, progress=False))"
EAGLE3=$(tail -n 1 "$OUT/boot_drafter.txt" 2>/dev/null)
check engine_deep 120 "${TS[@]}" bench engine --json --device cuda --dtype bfloat16 --policy deep --draft-policy micro \
  ${EAGLE3:+--eagle3 "$EAGLE3"} --batches 1,8,32,128 --ks 2,4,6 --repeats 2 --cost-repeats 1 --no-assisted
cat "$OUT/summary.txt"
