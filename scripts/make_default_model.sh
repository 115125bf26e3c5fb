#!/usr/bin/env bash
# The embedded default model pair, end to end: a Python-source corpus, a small Llama
# target trained from scratch, and its EAGLE-3 draft.
#
#   scripts/make_default_model.sh OUT_DIR
#
# Stages (wall time of each in OUT_DIR/timings.json, written after every stage):
#   1. corpus  build_corpus.py over the running Python's standard library (site-packages /
#              dist-packages skipped; the stdlib `test` package kept), unless CORPUS_DIR
#              names a corpus built before (e.g. on another machine and carried over).
#   2. target  train_target.py, 8 x 384 (tied vocab 8192, ~15.7M params, ~31.5 MB bf16),
#              time budget TARGET_BUDGET_S (the cosine schedule is fitted to the budget
#              from the step time measured during warm-up); or, with TARGET_DIR, a target
#              made before on the same corpus (same tokenizer.json), copied: only the
#              draft is retrained.
#   3. draft   train_draft.py (EAGLE-3 distilled on the target's distribution, borrowing
#              its LM head over the whole vocabulary, MLP 2048, ~3.4M params, ~7.0 MB bf16),
#              stage budget DRAFT_BUDGET_S: a short calibration run (it also collects the
#              target features into a shared cache) measures the step time, then a fresh
#              run with the step count that fits what is left of the budget.
#   4. export  the draft cast to bf16, sizes checked (target + draft <= 40 MB), a smoke
#              test (transformers generates from the target; eagle_jax loads both).
#
# Outputs:  OUT_DIR/target/  OUT_DIR/draft/  (the model pair, bf16 safetensors)
#           OUT_DIR/corpus/  corpus.json, train/heldout file lists, heldout.npy
#           OUT_DIR/logs/    target train_log.json, draft metrics, calibration, smoke test
#           OUT_DIR/timings.json  OUT_DIR/sizes.json
# Large intermediates (checkpoints, the draft's feature cache, several GB) go to WORK_DIR
# (default /tmp/eagle_default_model_work), never under OUT_DIR.
#
# Environment (defaults in brackets): PYTHON [python3], CORPUS_DIR [build], TARGET_DIR
# [train one], WORK_DIR, TARGET_BUDGET_S [240], DRAFT_BUDGET_S [180], TOTAL_BUDGET_S [510: the draft stage is cut
# to what is left of it], EXTRA_ROOTS [none: more source roots for the corpus],
# T_LAYERS [8] T_HIDDEN [384] T_HEADS [6] T_KV_HEADS [2] T_INTERMEDIATE [1024]
# SEQ_LEN [512] T_BATCH [64] T_STEPS [20000: upper bound, fitted to the budget]
# T_LR [3e-3] T_WARMUP [200] VOCAB [8192] D_VOCAB [4096] D_BATCH [32] D_TTT [5]
# D_LR [2e-3] D_WARMUP [100] D_SEQS [8192 sequences of SEQ_LEN for draft features]
# D_CALIB_STEPS [40] D_LABEL_MODE [soft: train_draft.py --label-mode, hard|soft]
# D_AUX_LAYERS [the trainer's: EAGLE-3 feature layers as layer OUTPUT ids, e.g. "1 4 6"]
# D_INTERMEDIATE [2048: the draft MLP width; empty = the target's]
# D_LM_HEAD [target: train_draft.py --lm-head; target = the target's head over the whole
# vocabulary (D_VOCAB ignored), own = a trained head over D_VOCAB tokens]
# MAX_TOTAL_MB [40] T_EXTRA_ARGS [more train_target.py flags].
set -euo pipefail
export PYTHONUNBUFFERED=1

OUT_DIR=${1:?usage: $0 OUT_DIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
WORK_DIR=${WORK_DIR:-${TMPDIR:-/tmp}/eagle_default_model_work}
TARGET_BUDGET_S=${TARGET_BUDGET_S:-240}
DRAFT_BUDGET_S=${DRAFT_BUDGET_S:-180}
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-510}
T_LAYERS=${T_LAYERS:-8}; T_HIDDEN=${T_HIDDEN:-384}; T_HEADS=${T_HEADS:-6}
T_KV_HEADS=${T_KV_HEADS:-2}; T_INTERMEDIATE=${T_INTERMEDIATE:-1024}
SEQ_LEN=${SEQ_LEN:-512}; T_BATCH=${T_BATCH:-64}; T_STEPS=${T_STEPS:-20000}
T_LR=${T_LR:-3e-3}; T_WARMUP=${T_WARMUP:-200}; T_EVAL_EVERY=${T_EVAL_EVERY:-250}
VOCAB=${VOCAB:-8192}; D_VOCAB=${D_VOCAB:-4096}; D_BATCH=${D_BATCH:-32}; D_TTT=${D_TTT:-5}
D_LR=${D_LR:-2e-3}; D_WARMUP=${D_WARMUP:-100}; D_SEQS=${D_SEQS:-8192}
D_CALIB_STEPS=${D_CALIB_STEPS:-40}; D_MAX_STEPS=${D_MAX_STEPS:-20000}
D_LABEL_MODE=${D_LABEL_MODE:-soft}
D_LM_HEAD=${D_LM_HEAD:-target}
D_INTERMEDIATE=${D_INTERMEDIATE-2048}  # set but empty: the target's width
MAX_TOTAL_MB=${MAX_TOTAL_MB:-40}

mkdir -p "$OUT_DIR"/{logs,corpus} "$WORK_DIR"
if [[ "${JAX_CACHE:-1}" != 0 ]]; then  # compiled programs reused across the processes
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK_DIR/jax_cache}
fi
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK_DIR=$(cd "$WORK_DIR" && pwd)
T0=$(date +%s.%N)
TIMINGS="$OUT_DIR/timings.json"
echo '{}' > "$TIMINGS"

now() { date +%s.%N; }
record() {  # record NAME START [EXTRA_JSON]
  local extra=${3:-}
  [[ -n "$extra" ]] || extra='{}'
  "$PY" - "$TIMINGS" "$1" "$2" "$(now)" "$T0" "$extra" <<'EOF'
import json, sys
path, name, start, end, t0, extra = sys.argv[1:]
d = json.load(open(path))
d[name] = dict(seconds=round(float(end) - float(start), 1), **json.loads(extra))
d["total_seconds"] = round(float(end) - float(t0), 1)
json.dump(d, open(path, "w"), indent=2)
print(f"== {name}: {d[name]['seconds']} s (total {d['total_seconds']} s)", flush=True)
EOF
}
elapsed() { "$PY" -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$T0" "$(now)"; }

echo "== $(date -u +%FT%TZ) make_default_model: OUT_DIR=$OUT_DIR WORK_DIR=$WORK_DIR"
"$PY" -c 'import sys, jax; print("python", sys.version.split()[0], "jax", jax.__version__, jax.devices())'

# ------------------------------------------------------------------ 1. corpus
S=$(now)
if [[ -n "${CORPUS_DIR:-}" ]]; then
  CORPUS=$(cd "$CORPUS_DIR" && pwd)
  for f in train.npy heldout.npy tokenizer.json tokenizer_config.json; do
    [[ -f "$CORPUS/$f" ]] || { echo "CORPUS_DIR=$CORPUS lacks $f" >&2; exit 2; }
  done
  echo "== corpus: using $CORPUS"
else
  STDLIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  CORPUS="$WORK_DIR/corpus"
  echo "== corpus: building from $STDLIB ${EXTRA_ROOTS:-}"
  # shellcheck disable=SC2086
  "$PY" "$REPO/scripts/build_corpus.py" --roots "$STDLIB" ${EXTRA_ROOTS:-} --out "$CORPUS" \
    --vocab-size "$VOCAB" --heldout-every 20 --no-progress
fi
for f in corpus.json train_files.txt heldout_files.txt heldout.npy; do
  [[ -f "$CORPUS/$f" ]] && cp "$CORPUS/$f" "$OUT_DIR/corpus/"
done
record corpus "$S" "$("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({k: d.get(k) for k in ("train_tokens","heldout_tokens","train_files","heldout_files")}))' "$CORPUS/corpus.json" 2>/dev/null || echo '{}')"

# ------------------------------------------------------------------ 2. target
S=$(now)
if [[ -n "${TARGET_DIR:-}" ]]; then  # retrain only the draft, on a target made before
  [[ -f "$TARGET_DIR/config.json" ]] || { echo "TARGET_DIR=$TARGET_DIR has no config.json" >&2; exit 2; }
  cmp -s "$TARGET_DIR/tokenizer.json" "$CORPUS/tokenizer.json" || {
    echo "TARGET_DIR=$TARGET_DIR was not trained on CORPUS=$CORPUS (their tokenizer.json differ)" >&2
    exit 2; }
  [[ "$(cd "$TARGET_DIR" && pwd)" == "$OUT_DIR/target" ]] || { rm -rf "$OUT_DIR/target"; cp -r "$TARGET_DIR" "$OUT_DIR/target"; }
  echo "== target: reusing $TARGET_DIR"
  record target "$S" "{\"reused\": \"$TARGET_DIR\"}"
else
  rm -rf "$WORK_DIR/target_run"  # a fresh run (stale checkpoints would mix in)
  "$PY" "$REPO/scripts/train_target.py" --corpus "$CORPUS" --out "$WORK_DIR/target_run" \
    --export-dir "$OUT_DIR/target" --layers "$T_LAYERS" --hidden "$T_HIDDEN" --heads "$T_HEADS" \
    --kv-heads "$T_KV_HEADS" --intermediate "$T_INTERMEDIATE" --seq-len "$SEQ_LEN" \
    --batch-size "$T_BATCH" --steps "$T_STEPS" --lr "$T_LR" --warmup "$T_WARMUP" \
    --dtype bfloat16 --seed 0 --eval-every "$T_EVAL_EVERY" --save-every 1000 \
    --time-budget-s "$TARGET_BUDGET_S" --fit-steps-to-budget --export-best --no-progress ${T_EXTRA_ARGS:-}
  [[ -f "$OUT_DIR/target/config.json" ]] || { echo "target training failed" >&2; exit 1; }
  cp "$WORK_DIR/target_run/train_log.json" "$OUT_DIR/logs/target_train_log.json"
  record target "$S" "$("$PY" -c 'import json,sys; f=json.load(open(sys.argv[1]))["final"]; print(json.dumps({k: f[k] for k in ("step","total_steps","heldout_loss","heldout_ppl","tokens_per_s","train_wall_s")}))' "$OUT_DIR/logs/target_train_log.json")"
fi

# ------------------------------------------------------------------ 3. draft
S=$(now)
LEFT=$("$PY" -c "import sys; print(min(float(sys.argv[1]), float(sys.argv[2]) - float(sys.argv[3]) - 20))" \
  "$DRAFT_BUDGET_S" "$TOTAL_BUDGET_S" "$(elapsed)")
echo "== draft: stage budget $LEFT s"
if [[ "$D_LM_HEAD" == target ]]; then  # the target's head: the whole vocabulary
  D_VOCAB=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
    "$OUT_DIR/target/config.json")
fi
DRAFT_JSONL="$WORK_DIR/draft_corpus.jsonl"
"$PY" -c "
import sys
from eagle_jax.train.corpus import write_ids_jsonl
n = write_ids_jsonl(sys.argv[1], sys.argv[2], row_tokens=8 * int(sys.argv[3]),
                    max_tokens=int(sys.argv[4]) * int(sys.argv[3]) + 1)
print('draft corpus:', n, 'rows')" "$CORPUS/train.npy" "$DRAFT_JSONL" "$SEQ_LEN" "$D_SEQS"
DATA_DIR="$WORK_DIR/draft_data"
COMMON=(--target "$OUT_DIR/target" --corpus "$DRAFT_JSONL" --data-dir "$DATA_DIR"
        --algorithm EAGLE3 --batch-size "$D_BATCH" --seq-len "$SEQ_LEN" --lr "$D_LR"
        --warmup "$D_WARMUP" --draft-vocab-size "$D_VOCAB" --ttt-steps "$D_TTT"
        --label-mode "$D_LABEL_MODE" --lm-head "$D_LM_HEAD"
        --dtype float32 --target-dtype bfloat16 --max-sequences "$D_SEQS"
        --collect-batch-size 64 --chunk-sequences 512 --seed 0 --no-progress)
if [[ -n "${D_INTERMEDIATE:-}" ]]; then
  COMMON+=(--intermediate-size "$D_INTERMEDIATE")
fi
if [[ -n "${D_AUX_LAYERS:-}" ]]; then
  # shellcheck disable=SC2206
  COMMON+=(--aux-layer-ids $D_AUX_LAYERS)
fi
rm -rf "$WORK_DIR/draft_calib" "$WORK_DIR/draft_run" "$DATA_DIR"  # features of THIS target
P1=$(now)
"$PY" "$REPO/scripts/train_draft.py" "${COMMON[@]}" --out "$WORK_DIR/draft_calib" \
  --steps "$D_MAX_STEPS" --stop-after "$D_CALIB_STEPS" --log-every 10 --eval-every 100000 \
  --save-every 100000
P2=$(now)
PLAN=$("$PY" -c "
import json, sys
from eagle_jax.train.pipeline import plan_draft_steps
a = sys.argv[1:]
plan = plan_draft_steps(a[0], a[1], float(a[2]), float(a[3]),
                        float(a[5]) - (float(a[3]) - float(a[4])), max_steps=int(a[6]))
json.dump(plan, open(a[7], 'w'), indent=2)
print(plan['steps'])" "$WORK_DIR/draft_calib" "$DATA_DIR" "$P1" "$P2" "$S" "$LEFT" \
  "$D_MAX_STEPS" "$OUT_DIR/logs/draft_calibration.json")
cat "$OUT_DIR/logs/draft_calibration.json"; echo
D_STEPS=$PLAN
if (( D_STEPS > 0 )); then
  D_EVAL=$(( D_STEPS / 4 > 50 ? D_STEPS / 4 : 50 ))
  echo "== draft: $D_STEPS steps"
  "$PY" "$REPO/scripts/train_draft.py" "${COMMON[@]}" --out "$WORK_DIR/draft_run" \
    --steps "$D_STEPS" --log-every 50 --eval-every "$D_EVAL" --save-every 100000 \
    | tee "$OUT_DIR/logs/draft_summary.txt"
  DRAFT_RUN="$WORK_DIR/draft_run"
else
  echo "WARNING: no time left for a draft run; keeping the calibration run's draft"
  DRAFT_RUN="$WORK_DIR/draft_calib"
  D_STEPS=$D_CALIB_STEPS
fi
cp "$DRAFT_RUN/metrics.jsonl" "$OUT_DIR/logs/draft_metrics.jsonl"
record draft "$S" "{\"steps\": $D_STEPS}"

# ------------------------------------------------------------------ 4. export + checks
S=$(now)
"$PY" - "$OUT_DIR" "$DRAFT_RUN/draft" "$MAX_TOTAL_MB" "$D_LM_HEAD" <<'EOF'
import json, sys
from eagle_jax.train.pipeline import cast_checkpoint, checkpoint_size_report
out, draft_src, max_mb, lm_head = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
cast_checkpoint(draft_src, f"{out}/draft", "bfloat16", max_shard_bytes=15 * 10**6)
rep = checkpoint_size_report({"target": f"{out}/target", "draft": f"{out}/draft"})
t = json.load(open(f"{out}/target/config.json"))
d = json.load(open(f"{out}/draft/config.json"))
H, L, F, V, K, D = (t["hidden_size"], t["num_hidden_layers"], t["intermediate_size"],
                    t["vocab_size"], t["num_key_value_heads"], t["head_dim"])
dv, dF = d.get("draft_vocab_size", V), d["intermediate_size"]
layer = H * H * 2 + 2 * H * K * D + 3 * H * F + 2 * H          # attn q,o + k,v + mlp + norms
expect_t = V * H + L * layer + H                                 # tied embedding + final norm
expect_d = (3 * H * H + (2 * H * H + 2 * 2 * H * K * D + H * H) + 3 * H * dF + 3 * H
            + H + (dv * H if lm_head == "own" else 0))           # fc, attn(2H in), mlp, norms, head
rep["expected_params"] = {"target": expect_t, "draft_float": expect_d}
rep["expected_bf16_mb"] = {"target": round(2 * expect_t / 1e6, 2),
                           "draft": round(2 * expect_d / 1e6 + (8 * dv + V) / 1e6, 2)}
total = rep["target"]["file_bytes"] + rep["draft"]["file_bytes"]
rep["total_mb"] = round(total / 1e6, 2)
rep["limit_mb"] = max_mb
json.dump(rep, open(f"{out}/sizes.json", "w"), indent=2)
print(json.dumps(rep, indent=2))
print(f"target {rep['target']['file_bytes'] / 1e6:.2f} MB + draft "
      f"{rep['draft']['file_bytes'] / 1e6:.2f} MB = {total / 1e6:.2f} MB "
      f"(limit {max_mb} MB): {'OK' if total <= max_mb * 1e6 else 'OVER THE LIMIT'}")
EOF
"$PY" - "$OUT_DIR" <<'EOF' 2>&1 | tee "$OUT_DIR/logs/smoke_test.txt" || echo "WARNING: smoke test failed"
import sys
out = sys.argv[1]
import torch, transformers
tok = transformers.AutoTokenizer.from_pretrained(f"{out}/target")
model = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/target").float()
prompt = "def fibonacci(n):\n"
ids = tok(prompt, return_tensors="pt").input_ids
gen = model.generate(ids, max_new_tokens=64, do_sample=False)
print("transformers greedy:\n" + tok.decode(gen[0]))
from eagle_jax.models.decoder import load_decoder
from eagle_jax.models.draft_checkpoint import load_draft
target = load_decoder(f"{out}/target", "bfloat16")
draft = load_draft(f"{out}/draft", target, "bfloat16")
print("eagle_jax loads target", target.config.num_layers, "layers and draft", type(draft).__name__)
EOF
record export "$S"
echo "== done: $OUT_DIR"
cat "$TIMINGS"
