"""Process plumbing shared by every role and by the launcher: the asyncio entry with a
signal-driven stop, the NATS connection frame (role.py), logging set-up, and the supervisor of
child processes. Imports nothing of ours but protocol/."""
