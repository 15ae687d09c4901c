"""Draw docs/grafting.svg: locator heads, writer heads and the graft (matplotlib).

Run from the repository root: ``python docs/make_grafting_figure.py`` (add ``--png`` for a
PNG preview beside it).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch  # noqa: E402

TURNS = ["planner", "coder", "critic", "coder", "critic"]
DECISIVE = 3
BLUE, ORANGE, GREY = "#1f6fb4", "#d9661f", "#9a9a9a"


def _arrow(ax, start, end, colour, width, style="-", rad=0.0, head=True):
    ax.add_patch(FancyArrowPatch(
        start, end, arrowstyle="-|>" if head else "-", mutation_scale=14 if head else 1,
        color=colour, linewidth=width, linestyle=style,
        connectionstyle=f"arc3,rad={rad}", shrinkA=0, shrinkB=2))


def figure():
    fig, ax = plt.subplots(figsize=(8.4, 3.9))
    ax.set_xlim(0, 10.5)
    ax.set_ylim(0, 5)
    ax.axis("off")
    ax.text(5.25, 4.75, "Grafting at the answer position", ha="center", fontsize=13,
            weight="bold")
    # the transcript and the answer position
    centres = []
    for i, speaker in enumerate(TURNS):
        x = 0.2 + i * 1.3
        decisive = i == DECISIVE
        ax.add_patch(FancyBboxPatch((x, 0.7), 1.15, 0.55, boxstyle="round,pad=0.02",
                                    facecolor="#fde9d9" if decisive else "#f2f2f2",
                                    edgecolor=ORANGE if decisive else "#bbbbbb", lw=1.5))
        ax.text(x + 0.575, 0.975, f"turn {i}\n{speaker}", ha="center", va="center",
                fontsize=8.5)
        centres.append(x + 0.575)
    ax.text(centres[DECISIVE], 0.45, "decisive turn", ha="center", fontsize=9, color=ORANGE)
    ax.add_patch(FancyBboxPatch((7.0, 0.7), 1.7, 0.55, boxstyle="round,pad=0.02",
                                facecolor="#e8f0f8", edgecolor=BLUE, lw=1.5))
    ax.text(7.85, 0.975, "\u201cStep: \u201d \u25b8 ?", ha="center", va="center",
            fontsize=9.5)
    ax.text(7.85, 0.45, "answer position (last prompt token)", ha="center", fontsize=9,
            color=BLUE)
    # locator head: attention concentrated on the decisive turn
    loc, wri = (5.6, 3.1), (8.2, 3.1)
    for (x, y), colour, label, name in ((loc, ORANGE, "L", "locator head"),
                                         (wri, BLUE, "W", "writer head")):
        ax.add_patch(Circle((x, y), 0.3, color=colour))
        ax.text(x, y, label, ha="center", va="center", color="white", fontsize=12,
                weight="bold")
        ax.text(x, y + 0.48, name, ha="center", fontsize=9.5, color=colour)
    _arrow(ax, (loc[0] - 0.2, loc[1] - 0.25), (centres[DECISIVE], 1.3), ORANGE, 3.5)
    _arrow(ax, (loc[0] - 0.3, loc[1] - 0.1), (centres[1], 1.3), ORANGE, 0.8, rad=0.1)
    # both heads sit at the answer position (their query is its token)
    for x, y in (loc, wri):
        _arrow(ax, (7.85, 1.27), (x, y - 0.3), "#c8d6e5", 1.0, style=":", head=False)
    # writer head: its own attention (replaced) and the grafted one
    for i in (0, 2, 4):
        _arrow(ax, (wri[0] - 0.25, wri[1] - 0.2), (centres[i], 1.3), GREY, 1.0, style="--",
               rad=0.15 if i < 4 else 0.0)
    ax.text(1.2, 2.35, "writer's own attention\n(replaced)", ha="center", fontsize=8.5,
            color=GREY)
    _arrow(ax, (loc[0] + 0.32, loc[1]), (wri[0] - 0.34, wri[1]), ORANGE, 2.2, style="--")
    ax.text((loc[0] + wri[0]) / 2, loc[1] + 0.12, "graft", ha="center", fontsize=10,
            color=ORANGE, weight="bold")
    _arrow(ax, (wri[0] - 0.1, wri[1] - 0.3), (centres[DECISIVE] + 0.35, 1.3), BLUE, 2.5,
           rad=-0.1)
    # the writer's output: the step-number logit
    _arrow(ax, (wri[0] + 0.3, wri[1] + 0.1), (9.7, 3.9), BLUE, 1.8)
    ax.text(9.75, 4.05, "logit of \u201c3\u201d \u2191", ha="right", fontsize=10, color=BLUE)
    ax.text(0.2, 0.05, "writer's new attention = mix \u00b7 mean(locators' attention) + "
            "(1 \u2212 mix) \u00b7 its own, at the answer position only", fontsize=8.5,
            color="#555555")
    return fig


if __name__ == "__main__":
    plt.rcParams["svg.fonttype"] = "none"   # text stays text
    plt.rcParams["svg.hashsalt"] = "skafa"  # the same file on every run
    out = Path(__file__).with_name("grafting.svg")
    fig = figure()
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    if "--png" in sys.argv:
        fig.savefig(out.with_suffix(".png"), dpi=110, bbox_inches="tight")
    sys.stdout.write(f"{out}\n")
