"""Many adapters, one base: K jobs' LoRAs trained on one frozen base model in one process (issues #46, #54).

layer.py       one base linear with every job's LoRA; rows (or token positions) routed to adapters, one matmul pair each
shared_base.py the frozen base: LoRAs attached and detached by job, the output for a routed batch
combine.py     the jobs' micro-batches as one batch: flat (end to end, none padded to another's width) or padded
varlen.py      attention over the flat batch, each job's rows under the model's own kernel and mask
job.py         one job's own state: optimizer, schedule, step, data order, accumulation, clipping, losses
job_losses.py  each job's loss from its part of the shared output (sft, dpo)
group.py       the step, top to bottom: one forward, one backward, each job stepping on its own; out of memory: undone
peft_export.py a job's adapter saved in peft's layout
member.py      what a trainer alone does around a job's steps: events, evaluation, samples, checkpoints, its end
split.py       a step out of memory: the largest job handed back to train alone, the rest go on
process.py     the group's trainer process: the agent's lines on stdin, each job's events (and attempt) on stdout
"""
