"""Draw a Chrome trace's ``vcga`` collectives as a timeline PNG (matplotlib; no trace viewer needed)::

    python examples/trace_timeline.py /tmp/hang/step0.json docs/debugging-step.png

One row per thread: the calling thread's ``vcga:<op>`` spans (and the autograd operations they
overlap, in grey), the communication threads' bridge and compression steps, and the flow arrows
vcga.profiling added from each call to its steps.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any


def draw(trace_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(trace_path) as f:
        events: list[dict[str, Any]] = json.load(f)["traceEvents"]
    vcga = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("vcga:")]
    if not vcga:
        raise SystemExit(f"{trace_path}: no vcga spans (was the step profiled on a vcga group?)")
    t0 = min(e["ts"] for e in vcga)
    t1 = max(e["ts"] + e["dur"] for e in vcga)
    callers = {e["tid"] for e in vcga if not e["name"].startswith(("vcga:in-", "vcga:cross-", "vcga:compress"))}
    autograd = [e for e in events if e.get("ph") == "X" and e.get("tid") in callers and e.get("cat") == "cpu_op"
                and str(e.get("name", "")).startswith("autograd::engine::evaluate_function")
                and e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    tids = sorted({e["tid"] for e in vcga}, key=lambda t: (t not in callers, t))
    row = {t: i for i, t in enumerate(tids)}
    colours = {"vcga:in-vendor": "tab:blue", "vcga:cross-vendor": "tab:orange", "vcga:compress": "tab:green"}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * len(tids)))
    for e in autograd:
        ax.barh(row[e["tid"]] + 0.3, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=0.25, color="0.8")
    labelled: set[str] = set()
    for e in vcga:
        key = next((k for k in colours if e["name"].startswith(k)), "call")
        colour = colours.get(key, "tab:red")
        label = {"call": "vcga:<op> (the call, on the calling thread)"}.get(key, key + " steps")
        ax.barh(row[e["tid"]], e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=0.5, color=colour, edgecolor="k",
                linewidth=0.4, alpha=0.85, label=None if label in labelled else label)
        labelled.add(label)
        if e["dur"] > 0.06 * (t1 - t0):
            ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, row[e["tid"]], e["name"].removeprefix("vcga:"),
                    ha="center", va="center", fontsize=7)
    flows: dict[Any, dict[str, dict[str, Any]]] = defaultdict(dict)
    for e in events:
        if e.get("cat") == "vcga" and e.get("ph") in ("s", "f"):
            flows[e["id"]][e["ph"]] = e
    for pair in flows.values():
        if "s" in pair and "f" in pair and pair["s"]["tid"] in row and pair["f"]["tid"] in row:
            s, f = pair["s"], pair["f"]
            ax.annotate("", xy=((f["ts"] - t0) / 1e3, row[f["tid"]] - 0.25),
                        xytext=((s["ts"] - t0) / 1e3, row[s["tid"]] + 0.25),
                        arrowprops={"arrowstyle": "->", "color": "0.35", "lw": 0.6})
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([f"{'calling thread' if t in callers else 'communication thread'}\n(tid {t})" for t in tids])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first collective")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"vcga collectives of one DDP step ({trace_path.rsplit('/', 1)[-1]})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    draw(sys.argv[1], sys.argv[2])
