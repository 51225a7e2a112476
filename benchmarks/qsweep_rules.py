"""A sweep's winners as dispatch rules: benchmarks/gpu_qsweep.py's JSON -> HETERO_QDISPATCH's.

    python benchmarks/qsweep_rules.py SWEEP.json RULES.json [--tokens 64] [--t-min 33]
        [--t-max 64] [--min-gain 1.05]

Per GGUF type and shape class (kernels/qdispatch.shape_class: the sweep's shapes of one class
share one rule), the candidate with the least time summed over the class's shapes at T = --tokens,
among those measured correct on every one of them; a rule for T in --t-min .. --t-max where it
beats `auto` (what qlinear runs today) by --min-gain. The rules file runs them in the engine
(`HETERO_QDISPATCH=RULES.json`) before they are written into qdispatch.RULES; each names the
sweep's architecture (`archs`), so a file carried to another GPU does not apply there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from qsweep_cells import ALL_SHAPES  # noqa: E402

from hetero.kernels.qdispatch import shape_class  # noqa: E402


def rules_from(
    rows: list[dict], tokens: int, t_min: int, t_max: int, min_gain: float, archs=()
):  # fmt: skip
    """(rules, report lines) from a sweep's rows; archs: the architectures the rules name (the
    sweep's device's), none: every one."""
    by_class: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
    for r in rows:
        if r.get("T") != tokens or not r.get("ok"):
            continue
        cls = shape_class(*ALL_SHAPES[r["shape"]])
        times = by_class.setdefault((r["type"], cls), {}).setdefault(r["variant"], {})
        times[r["shape"]] = r["us"]
    rules, lines = [], []
    for (ggml_type, cls), variants in sorted(by_class.items()):
        shapes = set().union(*(set(t) for t in variants.values()))
        whole = {v: sum(t.values()) for v, t in variants.items() if set(t) == shapes}
        if "auto" not in whole:
            lines.append(f"{ggml_type} {cls}: auto not measured on every shape; no rule")
            continue
        best = min(whole, key=whole.get)
        gain = whole["auto"] / whole[best]
        lines.append(
            f"{ggml_type} {cls} ({', '.join(sorted(shapes))}): {best} {whole[best]:.1f} us "
            f"against auto {whole['auto']:.1f} ({gain:.2f}x)"
        )
        if best != "auto" and gain >= min_gain:
            rules.append({"types": [ggml_type], "shapes": [cls], "t_min": t_min,
                          "t_max": t_max, "kernel": best})  # fmt: skip
            if archs:
                rules[-1]["archs"] = list(archs)
    return rules, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--t-min", type=int, default=33)
    ap.add_argument("--t-max", type=int, default=64)
    ap.add_argument("--min-gain", type=float, default=1.05)
    args = ap.parse_args()
    sweep = json.loads(Path(args.sweep).read_text())
    archs = [sweep["arch"]] if sweep.get("arch") else []  # (sweeps before 2026-12-06: none)
    rules, lines = rules_from(
        sweep["rows"], args.tokens, args.t_min, args.t_max, args.min_gain, archs
    )
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps(rules, indent=1))
    print(f"wrote {args.out}: {len(rules)} rules")


if __name__ == "__main__":
    main()
