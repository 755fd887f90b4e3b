"""An OpenAI-compatible fine-tuning API over the fleet: files, jobs, events and checkpoints, for OpenAI's clients."""
