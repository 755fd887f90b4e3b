"""Tinker's training sessions: where a forward_backward, optim_step, sample or save goes, for a session alone
(serve.py) or as a member of a session group (group.py, member.py), and the call ids already applied."""
