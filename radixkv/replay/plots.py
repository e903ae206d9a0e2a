"""The plots of a replay report (matplotlib, imported only when asked for)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from radixkv.replay.report import ReplayReport


def write_plots(report: ReplayReport, directory: str | Path) -> list[Path]:
    """hit_rate_over_time.png (the replay against the optimum and the ceiling) and
    latency_cdf.png (Match and Insert round trips) in `directory`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    r = report
    timed = bool(r.windows) and all(w.start_ms is not None for w in r.windows)
    xs = [(w.start_ms or 0.0) / 60e3 if timed else w.first_request for w in r.windows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(xs, [w.ceiling_hit_rate for w in r.windows], ":", color="grey",
            label=f"infinite capacity ({r.ceiling_token_hit_rate:.1%})")
    ax.plot(xs, [w.optimum_hit_rate for w in r.windows], "--", color="tab:green",
            label=f"offline optimum, Belady ({r.optimum_token_hit_rate:.1%})")
    ax.plot(xs, [w.token_hit_rate for w in r.windows], "-", color="tab:blue",
            label=f"service replay, {r.policy} ({r.token_hit_rate:.1%})")
    ax.set_xlabel("trace time (min)" if timed else "request")
    ax.set_ylabel("token hit rate (window)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"{Path(r.trace).name}: {r.capacity_blocks:,} blocks x {r.block_size} tokens, "
                 f"{r.clients} clients", fontsize=10)
    ax.legend(loc="best", fontsize=8)
    hit_path = out / "hit_rate_over_time.png"
    fig.tight_layout()
    fig.savefig(hit_path, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, samples in (("Match", r.match_samples_us), ("Insert", r.insert_samples_us)):
        if samples:
            s = np.sort(np.asarray(samples))
            ax.plot(s, np.arange(1, s.size + 1) / s.size, label=f"{name} (n={s.size:,})")
    ax.set_xscale("log")
    ax.set_xlabel("client round trip (us)")
    ax.set_ylabel("fraction of calls")
    ax.grid(alpha=0.3, which="both")
    ax.set_title(f"{Path(r.trace).name}: latency CDF, {r.clients} clients", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    cdf_path = out / "latency_cdf.png"
    fig.tight_layout()
    fig.savefig(cdf_path, dpi=120)
    plt.close(fig)
    return [hit_path, cdf_path]
