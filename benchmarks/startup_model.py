"""The cost model of group creation: fitted to what ``startup.py --launch forkserver --json`` measured, extrapolated.

Per variant (gloo, vcga, mixed) and per part of creation (the store-key categories of startup.py:
discovery, native groups, bridge sub-groups, whole-group gloo, calibration, torch's gloo group),
it fits the store's load -- requests and bytes of one start, in total -- as ``a + b·n + c·n²`` in
the world size n (least squares over the measured sizes, coefficients clipped at zero), and each
rank's CPU seconds per phase as ``a + b·n``. The store's server handles requests one at a time, so
a start costs at least ``requests × τ`` on it, whatever the cores: τ, the server's seconds per
request, is measured here (client threads hammering one TCPStore server with small requests).

The extrapolation to 1,024 and 10,240 ranks assumes what a cluster has and this machine does not --
a core per rank -- so a phase costs the slowest rank's CPU plus the store's serial time. That is a
lower bound (no network latency, no stragglers), and it is the part that grows with n.

Usage::

    python benchmarks/startup_model.py startup.json --plot docs/startup-model.png --markdown
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
from _ranks import table

#: What the extrapolation is asked for.
TARGETS = (1024, 10240)
#: The store-key categories that are vcga's own work (the rest: the vendor libraries and torch).
OWN = ("discovery", "bridge sub-groups", "whole-group gloo", "calibration", "other")


def fit(ns: list[int], ys: list[float], degree: int) -> np.ndarray:
    """Least-squares coefficients (constant first) of a polynomial of ``degree`` in n, none < 0
    (a negative coefficient is noise: it is dropped and the rest refitted)."""
    cols = list(range(degree + 1))
    while True:
        a = np.array([[float(n) ** k for k in cols] for n in ns])
        coef, *_ = np.linalg.lstsq(a, np.array(ys, dtype=float), rcond=None)
        if (coef >= 0).all() or len(cols) == 1:
            out = np.zeros(degree + 1)
            out[cols] = np.clip(coef, 0, None)
            return out
        cols.pop(int(np.argmin(coef)))


def evaluate(coef: np.ndarray, n: float) -> float:
    return float(sum(c * n ** k for k, c in enumerate(coef)))


def store_seconds_per_request(threads: int = 4, requests: int = 4000) -> float:
    """τ: the TCPStore server's wall seconds per request when clients keep it busy (``threads``
    clients of ``requests`` small ``check`` requests each, through the server's own port)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    server.set("k", "v")
    clients = [dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=60))
               for _ in range(threads)]

    def run(c: Any) -> None:
        for _ in range(requests):
            c.check(["k"])

    ts = [threading.Thread(target=run, args=(c,)) for c in clients]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return (time.perf_counter() - t0) / (threads * requests)


def model(data: dict[str, Any], tau: float) -> dict[str, Any]:
    out: dict[str, Any] = {"tau_s": tau, "variants": {}}
    sums = data["summaries"]
    ns = [s["world"] for s in sums]
    variants = [v for v in sums[0]["variants"] if all("store" in s["variants"].get(v, {}) for s in sums)]
    for v in variants:
        rows = [s["variants"][v] for s in sums]
        cats = sorted({c for r in rows for c in r["store"]["by_category"]})
        per_cat = {}
        for c in cats:
            req = [r["store"]["by_category"].get(c, [0, 0])[0] for r in rows]
            per_cat[c] = {"measured": req, "coef": fit(ns, req, 2).tolist()}
        total = [r["store"]["requests_total"] for r in rows]
        nbytes = [r["store"]["bytes_total"] for r in rows]
        cpu = [sum(r["phases_cpu_s"].values()) for r in rows]
        entry = {"ns": ns, "requests": {"measured": total, "coef": fit(ns, total, 2).tolist()},
                 "bytes": {"measured": nbytes, "coef": fit(ns, nbytes, 2).tolist()},
                 "cpu_per_rank_s": {"measured": cpu, "coef": fit(ns, cpu, 1).tolist()},
                 "categories": per_cat, "wall_s": [r["total_s"] for r in rows],
                 "ratio": [r.get("ratio") for r in rows]}
        entry["extrapolated"] = {}
        for n in TARGETS:
            req = evaluate(np.array(entry["requests"]["coef"]), n)
            own = sum(evaluate(np.array(per_cat[c]["coef"]), n) for c in cats if c in OWN)
            cpu_n = evaluate(np.array(entry["cpu_per_rank_s"]["coef"]), n)
            entry["extrapolated"][n] = {"requests": req, "own_requests": own, "store_s": req * tau,
                                        "own_store_s": own * tau, "cpu_per_rank_s": cpu_n,
                                        "lower_bound_s": cpu_n + req * tau,
                                        "per_rank_requests": req / n,
                                        "largest": max(cats, key=lambda c: evaluate(np.array(per_cat[c]["coef"]), n))}
        out["variants"][v] = entry
    return out


def render(m: dict[str, Any], markdown: bool) -> str:
    lines = [f"store server: τ = {m['tau_s'] * 1e6:.1f} µs per request (measured now)", ""]
    head = ["variant", "requests(n)", "CPU s/rank(n)"] + [f"{n} ranks: {x}" for n in TARGETS
                                                         for x in ("requests", "of them vcga's", "store s", "CPU s/rank",
                                                                   "largest part")]
    rows = []
    for v, e in m["variants"].items():
        r, c = e["requests"]["coef"], e["cpu_per_rank_s"]["coef"]
        row = [v, f"{r[0]:.0f} + {r[1]:.1f}·n + {r[2]:.2f}·n²", f"{c[0] * 1e3:.1f} ms + {c[1] * 1e6:.0f} µs·n"]
        for n in TARGETS:
            x = e["extrapolated"][n]
            row += [f"{x['requests']:.3g}", f"{x['own_requests']:.3g}", f"{x['store_s']:.3g}",
                    f"{x['cpu_per_rank_s']:.3g}", x["largest"]]
        rows.append(row)
    lines.append(table(head, rows, markdown))
    return "\n".join(lines)


def plot(m: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.4))
    xs = np.geomspace(4, max(TARGETS), 200)
    for (v, e), color in zip(m["variants"].items(), ("C0", "C1", "C2", "C3", "C4"), strict=False):
        ns = e["ns"]
        ax1.plot(ns, e["requests"]["measured"], "o", color=color, label=f"{v}: measured")
        ax1.plot(xs, [evaluate(np.array(e["requests"]["coef"]), x) for x in xs], "-", color=color, alpha=0.7,
                 label=f"{v}: fitted")
        if v != "gloo":
            own = [sum(evaluate(np.array(c["coef"]), x) for k, c in e["categories"].items() if k in OWN) for x in xs]
            own_m = [sum(c["measured"][i] for k, c in e["categories"].items() if k in OWN) for i in range(len(ns))]
            ax1.plot(ns, own_m, "^", color=color, alpha=0.6)
            ax1.plot(xs, own, ":", color=color, label=f"{v}: vcga's own parts")
        ax2.plot(ns, [r / n for r, n in zip(e["requests"]["measured"], ns, strict=False)], "o", color=color, label=f"{v}: measured")
        ax2.plot(xs, [evaluate(np.array(e["requests"]["coef"]), x) / x for x in xs], "-", color=color, alpha=0.7)
        ax3.plot(ns, [c * 1e3 for c in e["cpu_per_rank_s"]["measured"]], "o", color=color, label=f"{v}: measured")
        ax3.plot(xs, [evaluate(np.array(e["cpu_per_rank_s"]["coef"]), x) * 1e3 for x in xs], "-", color=color,
                 alpha=0.7, label=f"{v}: fitted a + b·n")
    for ax, title in ((ax1, "store requests of one start, in total"), (ax2, "store requests per rank"),
                      (ax3, "CPU ms per rank (a start, all phases)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title)
        for n in TARGETS:
            ax.axvline(n, color="grey", lw=0.5)
    ax1.legend(fontsize=7)
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="what benchmarks/startup.py --launch forkserver --json wrote (with store counts)")
    p.add_argument("--plot", help="write the plot here (PNG; needs matplotlib: pip install vcga[plot])")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", help="write the model (JSON) here")
    a = p.parse_args()
    with open(a.json) as f:
        data = json.load(f)
    m = model(data, store_seconds_per_request())
    print(render(m, a.markdown))
    if a.plot:
        plot(m, a.plot)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(m, f, indent=1)


if __name__ == "__main__":
    main()
