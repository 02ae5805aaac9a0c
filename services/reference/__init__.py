"""The reference log-probs: the service on the frozen initial policy (server.py) and its client
(client.py)."""
