"""The steady tokens/s of `fastweights train` runs from their log.jsonl (the running average that the log keeps
includes the first steps' compiles): step s's wall time since the loop began is done·tokens/tokens_per_s, so the
rate over steps ≥ `--skip` is (tokens at the last step − tokens at step skip) / (time at last − time at skip).

    python scripts/scale_summary.py --skip 3 RUN_DIR [RUN_DIR ...]    # one JSON line per run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def steady(log: Path, skip: int) -> dict:
    recs = [json.loads(x) for x in log.read_text().splitlines() if '"tokens_per_s"' in x]
    if not recs:
        return {"run": str(log.parent), "error": "no train records"}
    per_step = recs[0]["tokens"] // recs[0]["step"]
    first_step = recs[0]["step"] - 1  # (a resumed run's loop starts at its checkpoint)
    times = {r["step"]: (r["step"] - first_step) * per_step / r["tokens_per_s"] for r in recs}
    steps = sorted(times)
    a = next((s for s in steps if s >= first_step + skip), steps[0])
    b = steps[-1]
    out = {"run": log.parent.name, "steps": b, "tokens_per_step": per_step, "first_step_s": round(times[steps[0]], 2),
           "running_tokens_per_s": round(recs[-1]["tokens_per_s"]), "loss": recs[-1]["loss"]}
    if b > a:
        out["steady_tokens_per_s"] = round((b - a) * per_step / (times[b] - times[a]))
        out["steady_step_s"] = round((times[b] - times[a]) / (b - a), 4)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip", type=int, default=3, help="steps left out at the start (compiles, autotuning)")
    p.add_argument("runs", nargs="+")
    args = p.parse_args(argv)
    for run in args.runs:
        log = Path(run) / "log.jsonl"
        print(json.dumps(steady(log, args.skip) if log.is_file() else {"run": run, "error": "no log.jsonl"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
