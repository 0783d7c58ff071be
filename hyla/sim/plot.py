"""A PNG of token hit rate vs cache size, one line per policy, one panel per arrival rate."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hyla.sim.sweep import SweepPoint, hit_table


def plot_hit_rates(points: Sequence[SweepPoint], path: str | Path, title: str = "") -> Path:
    """Write the figure to ``path`` (PNG) and return it. Needs matplotlib (``pip install 'hyla[sim]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ValueError("plotting needs matplotlib: pip install 'hyla[sim]'") from e
    table = hit_table(points)
    rates = sorted({rate for rate, _ in table}, key=lambda r: -1.0 if r is None else r)
    policies = sorted({p.result.policy for p in points})
    cols = min(3, len(rates))
    rows = -(-len(rates) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False, sharey=True)
    for ax, rate in zip(axes.flat, rates):
        sizes = sorted(gb for r, gb in table if r == rate)
        for policy in policies:
            ax.plot(sizes, [100 * table[(rate, gb)][policy] for gb in sizes], marker="o", label=policy)
        ax.set_title("" if rate is None else f"{rate:g} sessions/s")
        ax.set_xlabel("cache size (GB)")
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("token hit rate (%)")
    for ax in list(axes.flat)[len(rates):]:
        ax.axis("off")
    axes.flat[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110, format="png")  # a PNG at exactly ``path``, whatever its suffix
    plt.close(fig)
    return path
