#!/bin/bash
# TRL on CPU (transformers generate), hidden_goal recipe of part P; args: SEED STEPS OUTJSON
# (run as `EVERY=15 timeout 2400 command.sh SEED 15 OUT.json`, seeds 0, 1, 2 one after another, 2026-12-05
# 06:45-08:11 UTC; beside seed 0's first steps a 35 s CPU test, a 9 s bench run and the duplicates check). TRL and datasets are not in the
# project's venv; they were put apart with
#   .venv/bin/python -m pip install --no-index --no-deps --find-links /opt/pypi/files --target /tmp/trlsite \
#       trl==1.16.0 datasets==5.0.1 dill multiprocess xxhash pyarrow fsspec pandas==2.3.3 pytz tzdata python-dateutil six
cd "$(git rev-parse --show-toplevel)"
PYTHONPATH=/tmp/trlsite exec .venv/bin/python bench/peer_trl.py --config deploy/configs/gpu-1.toml --env hidden_goal --model smol --no-vllm --steps $2 --eval-every ${EVERY:-10} \
  --set 'env.options={n_items = 120, seed = 0, nudge = "slots", answer = "mentions"}' --set data.eval_fraction=0.2 --set rollout.n=8 --set rollout.max_tokens=32 --set rollout.max_new_turns=6 --set actor.sampling.temperature=0.7 --set learner.groups_per_step=1 --set learner.lr=1e-4 --set learner.kl_coef=0.0 --set learner.eval_items=24 --set 'learner.behaviour_correction="truncated_is"' --set learner.checkpoint_every=1000 --set learner.seed=$1 --work /tmp/peer-trl-cpu-$1 --json $3
