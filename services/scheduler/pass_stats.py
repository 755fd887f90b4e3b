"""What placement passes cost the scheduler's loop: the budget one pass keeps to, and the figures of those that ran
(the leader's closing line, bench/control_plane.py and bench/fair_share.py read them)."""

from __future__ import annotations

from dataclasses import dataclass

PASS_BUDGET_S = 0.010  # one placement pass holds the loop at most this long (then the next one goes on)


@dataclass
class PassStats:
    """How long placement passes held the loop: the count, the longest, and how many ran out of their time; and the
    same without the garbage collector's pauses that landed in them (gc_pauses.spent_s); and the most CPU time any
    took, its own work (on a busy machine much of a pass can be the process waiting for a core)."""

    passes: int = 0
    longest_s: float = 0.0
    cut_short: int = 0
    longest_own_s: float = 0.0  # the longest, less the collections inside it
    own_cut_short: int = 0
    collected_in: int = 0  # passes a collection landed in
    longest_cpu_s: float = 0.0  # the most CPU time (the loop's thread) any pass took: its own work
    cpu_cut_short: int = 0  # passes whose CPU time alone was past the budget

    def passed(self, seconds: float, collecting_s: float = 0.0, cpu_s: float = 0.0) -> None:
        self.passes += 1
        self.longest_s, self.longest_cpu_s = max(self.longest_s, seconds), max(self.longest_cpu_s, cpu_s)
        self.cpu_cut_short += cpu_s > PASS_BUDGET_S
        self.cut_short += seconds > PASS_BUDGET_S
        self.longest_own_s = max(self.longest_own_s, seconds - collecting_s)
        self.own_cut_short += seconds - collecting_s > PASS_BUDGET_S
        self.collected_in += collecting_s > 0
