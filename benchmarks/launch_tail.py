"""Launch latency as a distribution: the tail, not only the median (issue #26).

    python benchmarks/launch_tail.py [--launches 100] [--rounds 4] [--pause 0.3] [--before DIR]

A trivial 2-rank all_reduce on the CPU, launched back to back and with ``--pause`` seconds
between launches, by nbddp (pre-warmed) and by Lightning Fabric's ``ddp_notebook`` (a fork of
the launching process). Each method runs ``--launches`` launches per mode, split over
``--rounds`` fresh processes that alternate between the methods (the machine is shared and
noisy: interleaving gives every method the same conditions). ``--before DIR``: also a tree of
nbddp from before the change (its package parent), run the same way. Prints a markdown table
of p50 / p90 / p99 / max and how many launches took over 200 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent


FAILED: dict[str, int] = {}  # launcher -> runs that failed and were run again


def _run(method: str, repeats: int, pause: float, tree: Path) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    for _ in range(2):  # once more if it failed (a shared machine): counted in the table
        done = subprocess.run(
            [sys.executable, str(HERE / "launchers.py"), method, str(repeats), str(pause)],
            env=env,
            cwd=tree,  # the helper's `python -c` imports nbddp from its working directory first
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            break
        FAILED[method] = FAILED.get(method, 0) + 1
        print(f"{method} failed, once more:\n{done.stderr[-2000:]}", file=sys.stderr)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    times: list[float] = json.loads(line[len("RESULT ") :])["repeated"]
    return times


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.3)
    parser.add_argument("--before", type=Path, default=None)
    args = parser.parse_args()
    methods = [("nbddp", "nbddp-warm", ROOT), ("Fabric ddp_notebook", "fabric", ROOT)]
    if args.before is not None:
        methods.insert(1, ("nbddp before #26", "nbddp-warm", args.before))
    per_round = args.launches // args.rounds
    rows = []
    for mode, pause in (("back to back", 0.0), (f"{args.pause:g} s apart", args.pause)):
        times: dict[str, list[float]] = {name: [] for name, _, _ in methods}
        for _ in range(args.rounds):
            for name, method, tree in methods:
                times[name] += _run(method, per_round, pause, tree)
        for name, _, _ in methods:
            t = times[name]
            rows.append(
                f"| {name} | {mode} | {len(t)} | {1000 * _quantile(t, 0.5):.0f} | "
                f"{1000 * _quantile(t, 0.9):.0f} | {1000 * _quantile(t, 0.99):.0f} | "
                f"{1000 * max(t):.0f} | {sum(x > 0.2 for x in t)} |"
            )
            print(rows[-1], flush=True)
    print()
    print("| launcher | launches | n | p50 ms | p90 ms | p99 ms | max ms | over 200 ms |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    failed = ", ".join(f"{method} {n}" for method, n in sorted(FAILED.items()))
    print(
        f"Runs that failed and were run again (their launches are not in the table): {failed}."
        if failed
        else "No run failed."
    )


if __name__ == "__main__":
    main()
