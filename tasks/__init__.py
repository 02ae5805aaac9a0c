"""The task definition of CollabLLM medium: the dataset loader, the bundled documents and system
prompts, task building and the train/eval split. Read by the feeder, the actors and the evaluation."""
