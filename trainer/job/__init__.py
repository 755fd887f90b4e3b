"""One job trained alone (`python -m trainer JOB.json`): the loop read top to bottom, where a job's step is
taken, and what surrounds it (setup, checkpoints, the best adapter, how a run ends, several devices, trackers)."""
