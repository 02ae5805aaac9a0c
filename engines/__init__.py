"""The LLM engines every role that generates shares: the vLLM engine wrapper, the OpenAI-compatible
backend, the request/reply service scaffolding of the simulator and judge, and the embedded-model
builders. Imports nothing of ours but protocol/."""
