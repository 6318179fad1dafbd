"""``vcga bench --plot``: busbw against message size, one panel per collective, one line per group
(out-of-place; in-place rows are in the table, --json and --csv).

matplotlib is an optional extra (``pip install 'vcga[plot]'``); the CLI checks for it before the run.
"""

from __future__ import annotations

from typing import Any


def _label(r: Any) -> str:
    who = "+".join(dict.fromkeys(r.backends))
    where = "" if r.tier == "world" else f" {r.tier} [{','.join(map(str, r.ranks))}]"
    return f"{r.group} ({who}){where}" if r.group == "vcga" else f"gloo{where}"


def plot_rows(rows: list[Any], path: str) -> None:
    """Write the plot to ``path`` (.png or .svg), atomically."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    import io

    from vcga.atomic import atomic_write_bytes

    ops = list(dict.fromkeys(r.op for r in rows))
    if not ops:
        raise ValueError("nothing was measured, nothing to plot")
    fig, axes = plt.subplots(1, len(ops), figsize=(5.2 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        series: dict[tuple[str, bool], list[Any]] = {}
        for r in rows:
            if r.op == op and r.size_bytes > 0 and not r.in_place:
                series.setdefault((_label(r) + (f" {r.dtype} {r.redop}" if r.redop != "none" else f" {r.dtype}"),
                                   r.in_place), []).append(r)
        for (label, in_place), pts in series.items():
            pts.sort(key=lambda r: r.size_bytes)
            ax.plot([r.size_bytes for r in pts], [max(r.busbw_gbps, 1e-6) for r in pts],
                    marker="o", markersize=3, linestyle="--" if label.startswith("gloo") else "-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{op}, out-of-place")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fmt = "svg" if path.lower().endswith(".svg") else "png"
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
