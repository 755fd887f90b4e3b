"""What a step minimises and how its inputs are made: sft's cross-entropy, dpo's preference loss, grpo's
policy loss over graded rollouts (sampled by the trainer or the node's engine), rft's prompts."""
