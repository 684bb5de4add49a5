"""The PNG: backward time relative to DeepSpeed alone, per workload
(matplotlib is imported only when a plot is drawn)."""
from __future__ import annotations

from typing import Any

PLOT_IMPLS = {"leaf-hooks": "tab:orange", "graphscale": "tab:green"}
PANEL_TITLES = {"launch": "launch-bound", "compute": "compute-bound"}
BAR_WIDTH = 0.36


def plot(summaries: list[dict[str, Any]], path: str, title: str) -> None:
    """One panel per size; one group of bars per workload, the implementations
    side by side, each bar drawn from the DeepSpeed-alone line (ratio 1.0) to
    its median ratio, whiskers over the inter-quartile range of the per-round
    ratios.  Hatched: gradients not exact.  Nothing joins different workloads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [lab for lab in PANEL_TITLES if any(s["size"] == lab for s in summaries)]
    fig, axes = plt.subplots(len(labels), 1, figsize=(9, 3.6 * len(labels) + 0.6), dpi=110, squeeze=False)
    for ax, label in zip(axes[:, 0], labels):
        panel(ax, label, [s for s in summaries if s["size"] == label])
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def bars(ax: Any, rows: list[dict[str, Any]], k: int, name: str) -> tuple[float, float]:
    """One implementation's bars, whiskers and labels; the lowest and highest value drawn."""
    xs = [n + (k - 0.5) * BAR_WIDTH for n in range(len(rows))]
    meds = [s["impl"][name]["ratio_median"] for s in rows]
    q1 = [s["impl"][name]["ratio_q1"] for s in rows]
    q3 = [s["impl"][name]["ratio_q3"] for s in rows]
    drawn = ax.bar(xs, [m - 1.0 for m in meds], BAR_WIDTH, bottom=1.0, color=PLOT_IMPLS[name],
                   edgecolor="black", linewidth=0.5, label=name)
    for bar_, s in zip(drawn, rows):
        if s["impl"][name]["max_rel_err"] >= 1e-5:
            bar_.set_hatch("///")
    ax.errorbar(xs, meds, yerr=[[m - a for m, a in zip(meds, q1)], [b - m for m, b in zip(meds, q3)]],
                fmt="none", ecolor="black", elinewidth=0.9, capsize=2.5)
    for x, m, b_ in zip(xs, meds, q3):
        ax.annotate(f"{m:.3f}", (x, max(m, b_, 1.0)), textcoords="offset points", xytext=(0, 2),
                    ha="center", va="bottom", fontsize=6.5, rotation=90)
    return min(*q1, *meds), max(*q3, *meds)


def panel(ax: Any, label: str, rows: list[dict[str, Any]]) -> None:
    """One size's panel: the bars of every implementation but DeepSpeed alone,
    its line at 1.0, and under each group its backward time."""
    from matplotlib.patches import Patch

    lo, hi = 1.0, 1.0
    for k, name in enumerate(PLOT_IMPLS):
        b_lo, b_hi = bars(ax, rows, k, name)
        lo, hi = min(lo, b_lo), max(hi, b_hi)
    ax.axhline(1.0, color="tab:blue", lw=1.4, label="DeepSpeed alone (= 1.0)")
    ticks = []
    for s in rows:
        ds = s["impl"]["deepspeed"]
        wrong = "\nDS wrong" if ds["max_rel_err"] >= 1e-5 else ""
        ticks.append(f"{s['workload']} h{s['hidden']}\n{ds['backward_ms_median']:.1f} ms{wrong}")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(ticks, fontsize=7.5)
    span = hi - lo
    ax.set_ylim(lo - 0.08 * span - 0.005, hi + 0.25 * span + 0.005)
    ax.set_ylabel("backward / DeepSpeed alone", fontsize=8)
    ax.tick_params(axis="y", labelsize=7.5)
    ax.grid(axis="y", lw=0.3, alpha=0.6)
    ax.set_title(f"{PANEL_TITLES[label]}: bars = median ratio, whiskers = inter-quartile range over rounds",
                 fontsize=8.5)
    handles, names = ax.get_legend_handles_labels()
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="///"))
    names.append("hatched: gradients not exact")
    ax.legend(handles, names, fontsize=7, ncol=4, loc="upper left")
