"""Many adapters, one base: K jobs' LoRAs trained on one frozen base model in one process (issue #46).

layer.py       one base linear with every job's LoRA; rows routed to adapters, one matmul pair per group
shared_base.py the frozen base: LoRAs attached and detached by job, the output for a routed batch
combine.py     the jobs' micro-batches stacked into one packed batch, each job's rows a span
job.py         one job's own state: optimizer, schedule, step, data order, accumulation, clipping, losses
job_losses.py  each job's loss from its rows of the shared output (sft, dpo)
group.py       the step, top to bottom: one forward, one backward, each job stepping on its own
peft_export.py a job's adapter saved in peft's layout
member.py      what a trainer alone does around a job's steps: events, evaluation, samples, checkpoints, its end
process.py     the group's trainer process: the agent's lines on stdin, each job's events on stdout
"""
