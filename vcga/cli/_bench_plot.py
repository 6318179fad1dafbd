"""``vcga bench --plot``: busbw against message size, one panel per collective, one line per group
(out-of-place; in-place rows are in the table, --json and --csv). A group's plain gloo twin
(``--compare gloo``) has the same colour, dashed.

matplotlib is an optional extra (``pip install 'vcga[plot]'``); the CLI checks for it before the run.
"""

from __future__ import annotations

import io
from typing import Any


def _where(r: Any) -> str:
    who = "+".join(dict.fromkeys(r.backends))
    return f"world ({who})" if r.tier == "world" else f"{r.tier} [{','.join(map(str, r.ranks))}] ({who})"


def plot_rows(rows: list[Any], path: str) -> None:
    """Write the plot to ``path`` (.png or .svg), atomically."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    from vcga.atomic import atomic_write_bytes

    ops = list(dict.fromkeys(r.op for r in rows))
    if not ops:
        raise ValueError("nothing was measured, nothing to plot")
    fig, axes = plt.subplots(1, len(ops), figsize=(5.6 * len(ops), 4.4), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, op in zip(axes[0], ops, strict=True):
        series: dict[tuple[str, str, str, str], list[Any]] = {}
        for r in rows:
            if r.op == op and r.size_bytes > 0 and not r.in_place:
                series.setdefault((_where(r), r.dtype, r.redop, r.group), []).append(r)
        places = list(dict.fromkeys(k[:3] for k in series))
        for (where, dtype, redop, group), pts in series.items():
            pts.sort(key=lambda r: r.size_bytes)
            what = f"{dtype} {redop}" if redop != "none" else dtype
            ax.plot([r.size_bytes for r in pts], [max(r.busbw_gbps, 1e-6) for r in pts], marker="o", markersize=3,
                    color=colours[places.index((where, dtype, redop)) % len(colours)],
                    linestyle="--" if group == "gloo" else "-",
                    label=f"{where} {what}" + (" -- plain gloo" if group == "gloo" else ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _p: ""))
        ax.set_title(f"{op}, out-of-place")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="svg" if path.lower().endswith(".svg") else "png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
