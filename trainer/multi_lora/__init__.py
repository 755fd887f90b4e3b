"""Many adapters on one frozen base, what a co-training group (trainer/co_train/) and a session group
(trainer/session/) share: the base held once, the LoRA layer over every member's rows, the flat attention layout,
the agent's control lines, a member's adapter saved as peft saves one."""
