"""The shared LLM services, each with its server, its client and its prompts in one sub-package:

- `sim/`: the user simulator (`parley sim`): server.py answers SimRequests on topology.SIM_SUBJECT,
  client.py is how the conversation loop asks it, prompts/ holds the prompt variants.
- `judge/`: the judge (`parley judge`): server.py extracts documents and rates interactivity,
  client.py is how a scorer asks it, prompts/ holds its rubrics.
- `reference/`: the reference log-probs (`parley reference`): server.py runs the frozen initial
  policy, client.py is how a scorer asks it.
- `combined.py`: `parley services`, the simulator and the judge in one process on one engine.
- `budget.py`: per-run limits on simulator and judge calls (a count budget, a rate limit) that make
  their callers wait; the actor and the scorer wrap their clients in it.

A neutral package below the roles: it imports protocol/, config/, engines/, rewards/ and runtime/,
never a role or deploy/ (tests/unit/test_layout.py). The `parley` commands in deploy/ only parse
options and call each server's `run`.
"""
