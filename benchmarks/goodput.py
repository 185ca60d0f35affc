"""Goodput at full scale: 54 simulated days of a 16,384-card job in a 165,888-card pool,
under matrixpool's recovery and four baselines, from one run of the simulator.

    .venv/bin/python benchmarks/goodput.py --json --plot-dir docs/img

Runs ``examples/simulate/llama3.yaml`` (or ``--file``) through :mod:`matrixpool.simulate`: the
real placement engine, ``matrixpool_recovery.policy.decide`` and ``timeshare.split`` over a
seeded failure trace at Llama 3's published rates. Prints the report; its last line is one
JSON object with ``goodput`` per policy (``matrixpool``, ``job_restart``, ``no_spares``,
``no_peer_copies``, ``tidal_restart``) and ``recovery_minutes_10k`` per level (one fault per
level on a 10,000-card job alone in the same pool). ``wall_seconds`` is this machine's time.
docs/benchmarks.md, "Goodput at scale (issue 17)", records the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from matrixpool.simulate import model, report

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "simulate" / "llama3.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--file", type=Path, default=EXAMPLE, help="the simulator's YAML")
    parser.add_argument("--seed", type=int, help="override the file's seed")
    parser.add_argument("--plot-dir", type=Path, help="write goodput.png and recovery-cdf.png")
    args = parser.parse_args()
    config = model.load(args.file)
    if args.seed is not None:
        config = config.with_seed(args.seed)
    figures = report.execute(config, args.plot_dir, progress=not args.json)
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)  # a shared machine skews times
    print(json.dumps(figures, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
