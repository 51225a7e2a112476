"""Fold a sweep of the Gluon lanes GEMV into the architecture's tuning table.

    python benchmarks/gemv_lanes_table.py SWEEP.json [--table kernels/gemv_tuning_sm_90.json]
        [--write]

SWEEP.json is `gpu_qmicro.py --tokens 1 --lanes ... --json` from one device: for every weight
(type, N, K) it timed, the lanes configs and `sk` (what the table dispatched then). Where a
lanes config was fastest, the table's entry for that type and shape takes it (added if the
table had no entry of that shape), its Triton config kept as the entry's `fallback` (Gluon does
not run everywhere); where `sk` won, the entry stays. Prints each decision; --write saves the
table (else a dry run). A new entry takes the short name the table gives that shape for other
types (qo, kv, qk, qkv, gateup2, down, lmhead).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from hetero.kernels.streamk import lanes_config as lanes_spec


def lanes_config(name: str) -> dict:
    """'lanesR/CPL/WK[/CTAS]' -> the table's config dict (streamk.lanes_config's fields)."""
    cfg = dataclasses.asdict(lanes_spec(name.removeprefix("lanes")))
    cfg.pop("fallback")  # the entry's own key
    return cfg


def fold(table: dict, sweep: dict, when: str) -> list[str]:
    """Update table's entries in place from sweep's T = 1 rows; the decisions, one a line."""
    notes = []
    entries = table.setdefault("entries", [])
    for row in sweep["rows"]:
        if row["T"] != 1:
            continue
        timed = {k: v for k, v in row.items() if isinstance(v, dict) and k.startswith("lanes")}
        if not timed:
            continue
        best = min(timed, key=lambda k: timed[k]["us"])
        n, k, t = int(row["n"]), int(row["k"]), row["type"]
        entry = next((e for e in entries if (e["type"], e["n"], e["k"]) == (t, n, k)), None)
        sk = row.get("sk")
        if sk is not None and sk["us"] <= timed[best]["us"]:
            notes.append(f"{t} {n}x{k}: kept ({sk['us']:.1f} us; best lanes {best} "
                         f"{timed[best]['us']:.1f})")  # fmt: skip
            continue
        if entry is None:  # named as the table names that shape for other types
            name = next((e["shape"] for e in entries if (e["n"], e["k"]) == (n, k)), f"{n}x{k}")
            entry = {"type": t, "shape": name, "n": n, "k": k}
            entries.append(entry)
        old = entry.get("config")
        if old is not None and not old.get("lanes"):
            entry["fallback"], entry["fallback_us"] = old, entry.get("us")
        entry.update(
            config=lanes_config(best), variant=best, us=round(timed[best]["us"], 2),
            gbps=round(timed[best]["gbs"], 1),
            measured=f"{when}, copy {sweep['copy_gbs']:.0f} GB/s",
        )  # fmt: skip
        entry.pop("note", None)
        was = f"{sk['us']:.1f} us" if sk else "no entry"
        notes.append(f"{t} {n}x{k}: {best} {timed[best]['us']:.1f} us (was {was})")
    return notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--table", type=Path, default=Path("kernels/gemv_tuning_sm_90.json"))
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    table = json.loads(args.table.read_text())
    when = time.strftime("%Y-%m-%d") + f" gpu_qmicro.py --lanes ({args.sweep.name})"
    for line in fold(table, json.loads(args.sweep.read_text()), when):
        print(line)
    if args.write:
        args.table.write_text(json.dumps(table, indent=1) + "\n")
        print("wrote", args.table)


if __name__ == "__main__":
    main()
