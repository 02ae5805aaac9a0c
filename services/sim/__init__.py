"""The user simulator: its service (server.py), its client (client.py) and its prompt variants
(prompts/, with opening.txt the stage direction every conversation opens with)."""
