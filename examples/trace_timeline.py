"""Draw a Chrome trace's ``vcga`` collectives as a timeline PNG (matplotlib; no trace viewer needed)::

    python examples/trace_timeline.py /tmp/hang/step0.json docs/debugging-step.png

One row per thread: the calling thread's ``vcga:<op>`` spans (one lane each where they overlap --
a call lasts until its work completes -- over the backward pass's autograd operations, in grey),
the communication threads' bridge and compression steps, and the flow arrows vcga.profiling
added from each call to its steps.
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
    # calls overlap on the calling thread (each lasts until its work completes): one lane each
    lanes: dict[int, list[float]] = {t: [] for t in tids}
    lane_of: dict[int, int] = {}
    for e in sorted(vcga, key=lambda e: e["ts"]):
        ends = lanes[e["tid"]]
        free = next((i for i, end in enumerate(ends) if end <= e["ts"]), len(ends))
        if free == len(ends):
            ends.append(0.0)
        ends[free] = e["ts"] + e["dur"]
        lane_of[id(e)] = free
    base, y = {}, 0.0
    for t in tids:
        base[t] = y
        y += max(len(lanes[t]), 1) * 0.6 + 0.6
    colours = {"vcga:in-vendor": "tab:blue", "vcga:cross-vendor": "tab:orange", "vcga:compress": "tab:green"}
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.75 * y))
    span_ms = (t1 - t0) / 1e3
    ms_per_char = span_ms * 6.5 / 1000  # fontsize 7 on a ~1000 px wide axis

    def at(e: dict[str, Any]) -> float:
        return base[e["tid"]] + 0.6 * lane_of.get(id(e), 0)

    for e in autograd:
        ax.barh(base[e["tid"]] - 0.45, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=0.2, color="0.75")
    labelled: set[str] = set()
    for e in vcga:
        key = next((k for k in colours if e["name"].startswith(k)), "call")
        label = "vcga:<op>: the call, on the calling thread" if key == "call" else key + " steps"
        ax.barh(at(e), e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=0.5, color=colours.get(key, "tab:red"),
                edgecolor="k", linewidth=0.4, alpha=0.85, label=None if label in labelled else label)
        labelled.add(label)
        # a step's tier is its colour: its name alone ("reduce_scatter", "exchange")
        text = e["name"].removeprefix("vcga:") if key == "call" else e["name"].split(" ")[1]
        if e["dur"] / 1e3 > ms_per_char * (len(text) + 2):
            ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, at(e), text, ha="center", va="center", fontsize=7)
    slices = {(e["tid"], round(e["ts"], 3)): e for e in vcga}
    flows: dict[Any, dict[str, dict[str, Any]]] = defaultdict(dict)
    for e in events:
        if e.get("cat") == "vcga" and e.get("ph") in ("s", "f"):
            flows[e["id"]][e["ph"]] = e

    def owner(p: dict[str, Any]) -> dict[str, Any] | None:
        inside = [x for (tid, _), x in slices.items() if tid == p["tid"] and x["ts"] <= p["ts"] <= x["ts"] + x["dur"]]
        return max(inside, key=lambda x: x["ts"]) if inside else None

    for pair in flows.values():
        if "s" in pair and "f" in pair:
            a, b = owner(pair["s"]), owner(pair["f"])
            if a is None or b is None:
                continue
            ax.annotate("", xy=((pair["f"]["ts"] - t0) / 1e3, at(b) - 0.25),
                        xytext=((pair["s"]["ts"] - t0) / 1e3, at(a) + 0.25),
                        arrowprops={"arrowstyle": "->", "color": "0.3", "lw": 0.6})
    ax.set_yticks([base[t] + 0.3 * (max(len(lanes[t]), 1) - 1) for t in tids])
    ax.set_yticklabels([f"{'calling thread' if t in callers else 'communication thread'}\n(tid {t})" for t in tids])
    ax.set_ylim(y - 0.2, -1.0)
    ax.set_xlabel("ms since the step's first collective")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=8, frameon=False)
    ax.set_title(f"vcga collectives of one DDP step ({trace_path.rsplit('/', 1)[-1]})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    draw(sys.argv[1], sys.argv[2])
