"""What a python grader's sandbox costs per call: a trivial grader's latency, one sample a call (start-up, cgroup,
filter, teardown: the grading hot path's fixed cost) and a batch of samples in one call, for this tree and a
baseline tree (another commit's, e.g. `git archive <commit> services schemas | tar -x -C /tmp/base`), in rounds
whose sides alternate, each side a fresh process. Prints each side's median and p10-p90 and the ratio of medians;
exits non-zero when a call does not score the grader's 1.0 (the guarantee it prints).

    .venv/bin/python bench/grader_sandbox.py --baseline /tmp/base --rounds 6 --calls 10 --batch 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDE = r"""
import json, sys, time
from services.graders import GraderContext, status
from services.graders.sandbox import run_python
calls, batch = int(sys.argv[1]), int(sys.argv[2])
found = status()
ctx = GraderContext(wall_s=5.0, cpu_s=5.0, memory_mib=256)
source = "def grade(sample, item):\n    return 1.0\n"
one, many, wrong = [], [], 0
for _ in range(calls):
    started = time.perf_counter()
    wrong += sum(r.score != 1.0 for r in run_python(source, [{"output_text": "x"}], [{}], ctx))
    one.append(time.perf_counter() - started)
started = time.perf_counter()
wrong += sum(r.score != 1.0 for r in run_python(source, [{"output_text": "x"}] * batch, [{}] * batch, ctx))
many.append(time.perf_counter() - started)
print(json.dumps({"isolated": found.isolated, "one": one, "batch": many, "wrong": wrong}))
"""


def side(tree: Path, calls: int, batch: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SIDE, str(calls), str(batch)], cwd=tree, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"the side in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def spread(values: list[float]) -> str:
    ordered = sorted(values)
    p10, p90 = ordered[len(ordered) // 10], ordered[min(len(ordered) - 1, len(ordered) * 9 // 10)]
    return f"median {statistics.median(ordered) * 1000:.1f} ms (p10 {p10 * 1000:.1f}, p90 {p90 * 1000:.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, help="another tree's root (services/ and schemas/ in it)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=10, help="one-sample calls per side per round")
    p.add_argument("--batch", type=int, default=50, help="samples in the one batch call per side per round")
    args = p.parse_args()
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    got: dict[str, dict[str, list[float]]] = {name: {"one": [], "batch": []} for name in trees}
    wrong = 0
    for r in range(args.rounds):
        for name in list(trees)[:: 1 if r % 2 == 0 else -1]:  # sides alternate: neither always runs first
            out = side(trees[name], args.calls, args.batch)
            if not out["isolated"]:
                print(f"warning: {name}'s sandbox is not isolated here")
            got[name]["one"] += out["one"]
            got[name]["batch"] += out["batch"]
            wrong += out["wrong"]
    for name in trees:
        print(f"{name:>9}: one sample a call {spread(got[name]['one'])}; {args.batch} samples in a call ", end="")
        print(spread(got[name]["batch"]))
    if args.baseline:
        for kind in ("one", "batch"):
            ratio = statistics.median(got["this"][kind]) / statistics.median(got["baseline"][kind])
            print(f"this/baseline, {kind}: {ratio:.2f}x")
    print(f"every call scored the grader's 1.0: {'yes' if not wrong else f'NO ({wrong} did not)'}")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
