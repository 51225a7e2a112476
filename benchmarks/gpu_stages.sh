# Sourced by the GPU session scripts: stages with a timeout and a log each, and the machine's
# description. Needs OUT (the log folder), PY and, for `has`, STAGES.

stage() {  # stage NAME SECONDS CMD...: run with a timeout, keep the log, say how it ended
  local name=$1 secs=$2
  shift 2
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (TIMED OUT)')"
}

has() { [[ " $STAGES " == *" $1 "* ]]; }

describe_machine() {  # the GPU, its driver, the host's CPU, the Python stack
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
  lscpu | grep -E "^(Model name|CPU\(s\)|Flags)" | cut -c1-160
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
}

peer_rows() {  # peer_rows STAGE...: each llama-bench -o json stage's results, a line a test
  local f
  for f in "$@"; do  # the JSON array among the log lines (stderr shares the file)
    "$PY" -c "import json; t = open('$OUT/$f.log').read(); t = t[t.index('['):t.rindex(']') + 1]
[print('$f', r['n_prompt'], r['n_gen'], round(r['avg_ts'], 1), '+-', round(r['stddev_ts'], 1))
 for r in json.loads(t)]" 2>/dev/null || tail -3 "$OUT/$f.log"
  done
}
