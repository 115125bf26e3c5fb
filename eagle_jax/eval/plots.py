"""PNG charts of an evaluation report (matplotlib, Agg backend)."""

from __future__ import annotations

import os


def write_plots(report: dict, out_dir: str) -> list[str]:
    """Writes accept_length.png, acceptance_per_position.png and
    accept_length_distribution.png for the speculative runs of ``report``; returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report.get("runs") or []
    os.makedirs(out_dir, exist_ok=True)
    if not runs:
        return []
    labels = [r["label"] for r in runs]
    paths = []

    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(runs) + 2), 4))
    means = [r["mean_accept_length"] for r in runs]
    bars = ax.bar(range(len(runs)), means, color="tab:blue")
    for b, m in zip(bars, means):
        ax.annotate(f"{m:.2f}", (b.get_x() + b.get_width() / 2, m), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(range(len(runs)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("mean accept length (tokens / request-step)")
    ax.set_title("Accept length per setting")
    ax.set_ylim(0, max(max(means) * 1.15, 1.2))
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "accept_length.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        acc = r["acceptance_per_position"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["label"])
    ax.set_xlabel("draft position (a tree: depth of the accepted path)")
    ax.set_ylabel("acceptance (share of request-steps)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance per draft position")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "acceptance_per_position.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(runs)
    for j, r in enumerate(runs):
        dist = r["accept_length_distribution"]
        ks = [int(k) for k in dist]
        ax.bar([k + (j - (len(runs) - 1) / 2) * width for k in ks], list(dist.values()),
               width=width, label=r["label"])
    ax.set_xlabel("accept length (tokens committed per request-step)")
    ax.set_ylabel("share of request-steps")
    ax.set_title("Accept length distribution")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "accept_length_distribution.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
