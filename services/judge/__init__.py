"""The judge: its service (server.py), its client (client.py) and its rubrics (prompts/)."""
