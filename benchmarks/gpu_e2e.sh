#!/usr/bin/env bash
# The main job on a GPU in one bounded run: the `gpu` policy preset pre-trained on the device, its first EAGLE-3
# drafter, the physical-limit figure, and `bench e2e --device cuda` (no SD, frozen and co-trained in lockstep:
# their ratios are taken side by side). Each check runs under its own timeout, is skipped (not started) when the
# budget left is less than it needs, and writes NAME.json (what the command printed on stdout) and NAME.txt (its
# log); summary.txt says which ran, how long each took and which were skipped.
#
# Usage:
#   bash benchmarks/gpu_e2e.sh --pack DIR          here, before a lease: the payload the device lacks, in DIR
#                                                  (the tailspec wheel, the pure-Python wheels the device image
#                                                  has not got, a redis-server binary with its libraries); prints
#                                                  its size and fails over 64 MiB. No Ray, no vLLM.
#   bash benchmarks/gpu_e2e.sh OUTDIR [BUDGET_S]   on the device (default budget 840 s): installs the payload from
#                                                  $PAYLOAD (default .payload) when python cannot import tailspec
#   bash benchmarks/gpu_e2e.sh OUTDIR [BUDGET_S] --dry
#                                                  the same checks on this CPU: --device cpu, the deep preset,
#                                                  2 steps of a smaller e2e (tests/test_gpu_e2e_script.py runs it)
# PYTHON=python3 (default) runs everything with `python -P` from /tmp, so the installed package is imported, not
# the checkout's tailspec/ (the roof only). STEPS=N sets the e2e's RL steps (default 6 on the device).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
MAX_PAYLOAD=$((64 << 20))
# the device image's Python and platforms (the wheels must match them); the packages it lacks (all else the
# package needs is in its image: torch, transformers, tokenizers, safetensors, numpy, rich, tqdm, yaml, ...)
DEVICE_PY=3.12
MISSING=(redis pydantic pydantic-core annotated-types typing-inspection)

pack() {
  local dir=$1
  rm -rf "$dir" && mkdir -p "$dir/wheels" "$dir/redis/lib" "$dir/bin" || return 1
  "$PY" -m pip wheel -q --no-deps -w "$dir/wheels" "$REPO" || return 1
  local specs=() name
  for name in "${MISSING[@]}"; do  # the versions this environment runs with
    specs+=("$name==$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')")
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir/wheels" "${specs[@]}" || return 1
  # redis-server and the libraries it links that a bare image may lack (glibc itself comes from the image);
  # a wrapper on PATH runs it with them
  local exe lib
  exe=$(readlink -f "$(command -v redis-server)") || { echo "redis-server not found here" >&2; return 1; }
  cp "$exe" "$dir/redis/redis-server"
  for lib in $(ldd "$exe" | awk '/=> \//{print $3}'); do
    case $(basename "$lib") in libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
      *) cp -L "$lib" "$dir/redis/lib/" ;; esac
  done
  cat > "$dir/bin/redis-server" <<'EOF'
#!/bin/sh
here=$(cd "$(dirname "$0")/../redis" && pwd)
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/redis-server" "$@"
EOF
  chmod +x "$dir/bin/redis-server"
  local size
  size=$(du -sb "$dir" | cut -f1)
  echo "payload $dir: $(ls "$dir/wheels" | wc -l) wheels, redis-server + $(ls "$dir/redis/lib" | wc -l) libraries;" \
    "$size bytes ($((size >> 20)) MiB of the 64 MiB a call carries)"
  [ "$size" -le "$MAX_PAYLOAD" ] || { echo "payload over 64 MiB" >&2; return 1; }
}

if [ "${1:-}" = "--pack" ]; then
  pack "${2:?usage: gpu_e2e.sh --pack DIR}"
  exit $?
fi

OUT=${1:?usage: gpu_e2e.sh OUTDIR [BUDGET_S] [--dry] | --pack DIR}
BUDGET=${2:-840}
DRY=${3:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
: > "$OUT/summary.txt"

if [ "$DRY" = "--dry" ]; then
  # a smaller run: the dry mode checks the script, not the figures (POLICY=tiny: a policy make test has cached)
  DEVICE=cpu POLICY=${POLICY:-deep} STEPS=${STEPS:-2} BATCHES=1
  E2E=(--workers 2 --prompts 4 --group 2 --bootstrap-samples 16 --bootstrap-steps 4 --skip-first 0
       --set rollout.k_max=2 --set rollout.trees=false)
  BOOT=(16 4)
else
  DEVICE=cuda POLICY=gpu STEPS=${STEPS:-6} BATCHES=1,8,64
  E2E=()
  BOOT=()
fi

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# check NAME NEED_S CMD...: CMD's stdout to OUT/NAME.json, its stderr to OUT/NAME.txt, under at most 2 x NEED_S
# (never past the budget); skipped when less than NEED_S is left
check() {
  local name=$1 need=$2
  shift 2
  local l
  l=$(left)
  if [ "$l" -lt "$need" ]; then
    echo "SKIP $name (needs ${need} s, ${l} s left)" | tee -a "$OUT/summary.txt"
    return
  fi
  local limit=$((need * 2 < l ? need * 2 : l)) t
  t=$(date +%s)
  (cd /tmp && timeout "$limit" "$@") > "$OUT/$name.json" 2> "$OUT/$name.txt"
  LAST_RC=$?
  echo "$name rc=$LAST_RC $(($(date +%s) - t)) s" | tee -a "$OUT/summary.txt"
}

# the payload, where the python here cannot import tailspec (the device: its image has torch, not us)
if ! (cd /tmp && "$PY" -P -c "import tailspec" 2>/dev/null); then
  PAYLOAD=$(cd "${PAYLOAD:-$REPO/.payload}" 2>/dev/null && pwd) || { echo "no payload: run --pack first" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tailspec-site \
    "$PAYLOAD"/wheels/*.whl || exit 2
  export PYTHONPATH=/tmp/tailspec-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! command -v redis-server >/dev/null && [ -x "${PAYLOAD:-$REPO/.payload}/bin/redis-server" ]; then
  export PATH="$(cd "${PAYLOAD:-$REPO/.payload}/bin" && pwd):$PATH"
fi

{ nvidia-smi 2>&1 || echo "no nvidia-smi"; nproc; command -v redis-server; "$PY" -P -c "import sys, torch, transformers, \
tailspec; print(sys.version); print('torch', torch.__version__, 'transformers', transformers.__version__, 'tailspec', \
tailspec.__file__); print(torch.cuda.get_device_properties(0) if torch.cuda.is_available() else 'no CUDA')"; } \
  > "$OUT/env.txt" 2>&1
echo "device $DEVICE, policy $POLICY, e2e $STEPS steps, budget $BUDGET s" | tee -a "$OUT/summary.txt"

TS=("$PY" -P -m tailspec.cli)  # an array, not a function: `timeout` runs programs only

# 1. the policy: pre-trained where it will run (the `gpu` preset prefers CUDA), cached under $TAILSPEC_CACHE
check policy 180 "$PY" -P -c "import json; from tailspec.tasks.policy import get_policy, policy_meta; \
p = get_policy('$POLICY', device='$DEVICE', progress=False); m = policy_meta(p); \
print(json.dumps({'path': str(p), **{k: m.get(k) for k in ('params', 'train_seconds', 'accuracy', 'alt_style')}}))"
# 2. its first drafter with the demo's settings (the frozen baseline and the lineage's start)
check drafter 90 "$PY" -P -c "import json, time; from tailspec.core.config import TailspecConfig; \
from tailspec.demo.bootstrap import bootstrap_drafter; from tailspec.demo.options import DemoOptions, apply_demo_trainer; \
from tailspec.tasks.policy import resolve_policy; c = TailspecConfig(); d = c.model_copy(deep=True); \
apply_demo_trainer(d.trainer, DemoOptions.validation_samples); t = time.time(); o = DemoOptions(); \
n, steps = [int(x) for x in '${BOOT[*]:-}'.split()] or (o.bootstrap_samples, o.bootstrap_steps); \
path = bootstrap_drafter(resolve_policy('$POLICY', c.task, cache_dir=c.cache_dir), d, n, \
o.bootstrap_seconds, steps=steps, progress=False, device='$DEVICE'); \
print(json.dumps({'path': path, 'seconds': round(time.time() - t, 1)}))"
# 3. the physical limit: the no-SD decode step over the HBM floor, eager and replayed
DTYPE=$([ "$DEVICE" = cuda ] && echo bfloat16 || echo float32)
check hbm_floor 60 "${TS[@]}" bench engine --json --device "$DEVICE" --dtype "$DTYPE" --policy "$POLICY" \
  --hbm-floor "$BATCHES" --max-tokens 128
# 4. the main job, three modes side by side
check e2e 420 "${TS[@]}" bench e2e --json --device "$DEVICE" --policy "$POLICY" --steps "$STEPS" \
  --out "$OUT/e2e-runs" "${E2E[@]}"

# the figures the GPU checks record, from the e2e's JSON
"$PY" -P - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None
e2e, floor = load("e2e"), load("hbm_floor")
if e2e:
    keys = ("speedup_vs_nospec", "speedup_vs_frozen_last_third", "training_share", "reclaimed_share", "promotions",
            "acceptance_first_last")
    print("e2e: " + json.dumps({k: e2e.get(k) for k in keys} | {"placement": e2e.get("placement", {}).get("note")}))
if floor:
    print("step_over_hbm_floor: " + json.dumps(floor.get("step_over_hbm_floor")))
EOF
