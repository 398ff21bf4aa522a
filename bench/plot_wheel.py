"""Plot the figures of ``bench/wheel.py --json`` for the docs (needs matplotlib).

python bench/wheel.py --json wheel.json
python bench/plot_wheel.py wheel.json            # writes docs/img/wheel-*.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
COLORS = {"wheel": "#1f77b4", "heap": "#d62728"}
LABELS = {"wheel": "TimingWheel", "heap": "heapq, lazy cancel"}


def plot_curve(result: dict[str, Any], path: Path) -> None:
    """Drain CPU per fired timer against the pending count, both sides."""
    curve = result["curve"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for side in ("wheel", "heap"):
        ax.plot(curve["sizes"], curve[f"{side}_ns"], "o-", color=COLORS[side], label=LABELS[side])
        for x, y in zip(curve["sizes"], curve[f"{side}_ns"], strict=True):
            ax.annotate(
                f"{y:,.0f}",
                (x, y),
                textcoords="offset points",
                xytext=(0, 6) if side == "heap" else (5, -12),
                ha="center" if side == "heap" else "left",
                fontsize=8,
                color=COLORS[side],
            )
    ax.plot(
        curve["sizes"],
        curve["floor_ns"],
        "--",
        color="grey",
        label="floor: one dict delete per timer",
    )
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("pending timers (1 timer per ms, so n pending span n ms)")
    ax.set_ylabel("CPU ns per fired timer")
    ax.set_title("Draining: cost per fired timer as the pending count grows")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_rates(result: dict[str, Any], path: Path) -> None:
    """Insert, cancel and drain rates per distribution, both sides, 1M pending."""
    groups = [
        (f"{op}\n{dist}", result[dist][key])
        for dist in ("uniform_1h", "mixed")
        for op, key in (
            ("insert", "insert_per_s"),
            ("cancel", "cancel_per_s"),
            ("drain", "drain_per_s"),
        )
    ]
    fig, ax = plt.subplots(figsize=(7.6, 4.0), dpi=120)
    width = 0.38
    for k, side in enumerate(("wheel", "heap")):
        xs = [i + (k - 0.5) * width for i in range(len(groups))]
        values = [rates[side] / 1e6 for _, rates in groups]
        ax.bar(xs, values, width, color=COLORS[side], label=LABELS[side])
        for x, v in zip(xs, values, strict=True):
            ax.annotate(
                f"{v:.2f}",
                (x, v),
                textcoords="offset points",
                xytext=(0, 2),
                ha="center",
                fontsize=7,
            )
    ax.set_xticks(range(len(groups)), [name for name, _ in groups], fontsize=8)
    ax.set_ylabel("million timers per CPU second")
    ax.set_title(f"{result['uniform_1h']['n']:,} pending timers; cancels in random order")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Read the JSON, write the PNGs."""
    parser = argparse.ArgumentParser(description="Plot bench/wheel.py --json output.")
    parser.add_argument("json", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args(argv)
    result = json.loads(args.json.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    plot_curve(result, args.out / "wheel-curve.png")
    plot_rates(result, args.out / "wheel-rates.png")
    print(f"wrote {args.out / 'wheel-curve.png'} and {args.out / 'wheel-rates.png'}")


if __name__ == "__main__":
    main()
