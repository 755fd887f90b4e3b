"""What a bench promises, checked where it is printed: each broken promise is named on a last line and makes the
bench exit non-zero, so a run by hand or by a reviewer cannot pass a broken guarantee unseen.

    promises = Guarantees()
    promises.check(peak <= bound, f"peak {peak:.0f} MiB within the bound {bound:.0f} MiB")
    ...
    sys.exit(promises.verdict())
"""

from __future__ import annotations


class Guarantees:
    """The promises one bench run checked, and which of them broke."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.broken: list[str] = []

    def check(self, ok: bool, promise: str) -> bool:
        """Record `promise` (said as what should hold) as kept or broken; returns ok."""
        (self.held if ok else self.broken).append(promise)
        return ok

    def verdict(self) -> int:
        """Print what held and what broke; the exit status: 0 when every promise held, 1 when one broke."""
        if self.broken:
            print(f"\nBROKEN ({len(self.broken)} of {len(self.broken) + len(self.held)} promises):", flush=True)
            for promise in self.broken:
                print(f"  - {promise}", flush=True)
            return 1
        print(f"\nall {len(self.held)} promises held", flush=True)
        return 0
