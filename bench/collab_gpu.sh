#!/usr/bin/env bash
# Issue 31: CollabLLM medium trained on one GPU and benchmarked like the card, in two device calls of at
# most 10 minutes each, back to back (the run directory lives under /tmp on the device, which persists
# only while the machine stays warm):
#     bash bench/collab_gpu.sh 1   # parley up --config $CONFIG: STEPS steps, periodic eval every 10 versions
#     bash bench/collab_gpu.sh 2   # parley eval of v0, the 25/50/75/100 % versions, the selected one and
#                                  # proact prompting on v0; parley select, replay (second judge), report;
#                                  # bench/collab_table.py -> $OUT/collab_gpu_h200.json
# CONFIG defaults to deploy/configs/gpu-1-collab.toml; the CPU smoke run passes the tiny one with
# EXTRA (more --set arguments for every command) and smaller STEPS / ITEMS. Each command has its own time
# limit so one hang leaves the others. The device brings back at most 8 files from $OUT, so each
# command's log goes to $LOGS and the phase ends by packing them into $OUT/logs<phase>.tar.gz:
#     phase 1: times.txt metrics.jsonl eval_history.jsonl steps.log logs1.tar.gz
#     phase 2: times.txt collab_gpu_h200.json eval_table.md eval_chart.png collab_rewards.png
#              collab_eval.png logs2.tar.gz
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CONFIG=${CONFIG:-deploy/configs/gpu-1-collab.toml}
RUN=${RUN_DIR:-/tmp/run-collab}
STEPS=${STEPS:-60}
ITEMS=${ITEMS:-24}         # held-out items, the periodic eval's (its first ITEMS of the eval split)
TURNS=${TURNS:-6}          # as [rollout] max_new_turns / max_tokens of CONFIG: one task shape
TOKENS=${TOKENS:-256}
read -r -a EXTRA <<<"${EXTRA:-}"
LOGS=/tmp/collab-logs${1:-}
rm -rf "$LOGS"
mkdir -p "$LOGS"
pack() {  # every log of this phase (and what else is named) into one file of $OUT
    tar -czf "$OUT/logs$1.tar.gz" -C "$LOGS" . 2>/dev/null
}
PY=${PYTHON:-python3}
parley() { "$PY" -m parley.deploy.cli "$@"; }
# step NAME LIMIT_S CMD...: CMD with a time limit, its log in $LOGS/NAME.log, its time in $OUT/times.txt
STEP_LOGS=$LOGS STEP_TAG=collab_gpu STEP_TIMES=$OUT/times.txt STEP_TAIL=15
source "$(dirname "$0")/step.sh"
case "${1:-}" in
1)
    rm -rf "$RUN"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    # the model (SmolLM2; BUILD=tiny for the smoke run) built before the clock of the run starts (a minute on a fresh machine)
    step build_model 150 "$PY" -c "from parley.engines.models import ensure_model; ensure_model('${BUILD:-smol}')"
    # the wall budget (SIGINT: the learner stops after its step; `plan` then picks from what was kept)
    step up "${LIMIT_S:-530}" timeout -s INT "${BUDGET_S:-480}" "$PY" -m parley.deploy.cli up --config "$CONFIG" \
        --no-live --run-dir "$RUN" --steps "$STEPS" --set "learner.eval_items=$ITEMS" "${EXTRA[@]}"
    for f in metrics.jsonl eval/history.jsonl; do
        [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/$(echo "$f" | tr / _)"
    done
    grep -h -E ': step [0-9]+: loss|eval: version' "$RUN/logs/learner.log" >"$OUT/steps.log" 2>/dev/null
    ls "$RUN/learner/ckpt" >"$LOGS/ckpt_list.txt" 2>/dev/null
    du -sh "$RUN" >>"$LOGS/ckpt_list.txt" 2>/dev/null
    cp "$RUN/summary.json" "$LOGS/" 2>/dev/null
    for f in "$RUN"/logs/*.log "$RUN"/eval/follow.log; do  # the roles' logs, their ends
        [ -f "$f" ] && tail -n 400 "$f" >"$LOGS/run_$(basename "$f")"
    done
    pack 1
    ;;
2)
    [ -d "$RUN/learner" ] || { echo "[collab_gpu] no run in $RUN: run phase 1 first, on this warm machine" >&2; exit 2; }
    M=/tmp/collab-models EV=/tmp/collab-eval RP=/tmp/collab-replay
    rm -rf "$M" "$EV" "$RP"
    # 0, the versions at 25/50/75/100 % of the run and the one `parley select` names by MR
    parley select "$RUN" --metric mr 2>&1 | tee "$LOGS/select.txt"
    VERSIONS=$("$PY" bench/collab_table.py plan "$RUN") || exit 1
    cp "$RUN/collab_plan.json" "$LOGS/"
    echo "[collab_gpu] versions: $VERSIONS"
    CONDS=()
    for V in $VERSIONS; do
        step "export_v$V" 120 "$PY" -m parley.deploy.cli export "$RUN" "$M/v$V" --version "$V" || exit 1
        CONDS+=(-C "v$V=$M/v$V")
    done
    CONDS+=(-C "proact=$M/v0,system_prompt=proactive")
    LAST=$(sed -n 's/.*"last": \([0-9]*\).*/\1/p' "$RUN/collab_plan.json")
    # every arm on the same held-out items and simulator seeds, sim + judge in this process; one policy
    # engine for all arms (the checkpoints' weights are swapped in: evaluation.runner.SwappingPolicies),
    # so CUDA graphs are captured once and pay off over the 7 arms
    step eval "${EVAL_LIMIT_S:-420}" "$PY" -m parley.deploy.cli eval --config "$CONFIG" "${CONDS[@]}" --baseline v0 \
        --services local --n-items "$ITEMS" --max-new-turns "$TURNS" --assistant-max-tokens "$TOKENS" \
        --concurrency "$ITEMS" --out "$EV" "${EXTRA[@]}"
    cp "$EV/table.md" "$OUT/eval_table.md" 2>/dev/null
    cp "$EV/chart.png" "$OUT/eval_chart.png" 2>/dev/null
    # the final version's conversations judged again by a second judge configuration: the same model
    # sampling at temperature 0.7 and the levels it writes (rubric), not the expected level at greedy
    "$PY" bench/collab_table.py pick "$EV/records.parquet" "v$LAST" /tmp/collab-final.parquet
    rm -rf /tmp/collab-nats
    parley nats --store-dir /tmp/collab-nats --port 4299 >"$LOGS/replay_nats.log" 2>&1 &
    NATS_PID=$!
    J2=(--config "$CONFIG" --nats nats://127.0.0.1:4299 --run collab-replay --set judge.temperature=0.7
        --set scorer.interactivity=\"rubric\" --set judge.engine.enforce_eager=true "${EXTRA[@]}")
    sleep 3
    parley judge "${J2[@]}" >"$LOGS/replay_judge.log" 2>&1 &
    JUDGE_PID=$!
    for _ in $(seq 120); do  # its engine's start: replay asks once and fails on no responder
        grep -q ": serving " "$LOGS/replay_judge.log" && break
        kill -0 "$JUDGE_PID" 2>/dev/null || break
        sleep 1
    done
    step replay "${REPLAY_LIMIT_S:-150}" "$PY" -m parley.deploy.cli replay /tmp/collab-final.parquet --judge \
        --out "$RP" "${J2[@]}"
    kill "$JUDGE_PID" 2>/dev/null; wait "$JUDGE_PID" 2>/dev/null
    kill "$NATS_PID" 2>/dev/null; wait "$NATS_PID" 2>/dev/null
    step report 60 "$PY" -m parley.deploy.cli report "$RUN"
    for f in rewards.png eval.png; do cp "$RUN/report/$f" "$OUT/collab_$f" 2>/dev/null; done
    REPLAY_ARG=()
    [ -f "$RP/records.parquet" ] && REPLAY_ARG=(--replay "$RP")
    "$PY" bench/collab_table.py build --run "$RUN" --eval "$EV" "${REPLAY_ARG[@]}" --json "$OUT/collab_gpu_h200.json"
    cp "$EV/table.csv" "$EV/unscored.jsonl" "$LOGS/" 2>/dev/null
    cp "$RP/table.md" "$LOGS/replay_table.md" 2>/dev/null
    pack 2
    ;;
*)
    echo "usage: bash bench/collab_gpu.sh 1|2" >&2
    exit 2
    ;;
esac
