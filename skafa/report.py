"""Attribution reports people can look at: a self-contained HTML page and PNG plots.

:func:`attribution_html` renders one :class:`~skafa.Attribution` as a single
HTML page with inline CSS and an inline SVG score strip: no JavaScript, no
network access (a Content-Security-Policy forbids it), so it opens the same
from a mail attachment, a CI artifact or a file share. It shows

- the blamed turn and agent, with the probability of that turn;
- the annotated decisive turn and agent, when the conversation is labelled,
  and whether the attribution found it;
- the runner-up turns (the attribution's ``top_k``) with scores and probabilities;
- the transcript, each turn with a colour band for its score (pale: low, dark
  red: high), the blamed turn outlined, the annotated turn marked.

:func:`plot_turn_scores` draws the per-turn scores as a PNG;
:func:`plot_site_scores` draws a fitted attributor's cross-validated step
accuracy at every activation site it compared (``cv_results_``), the site
search behind the prediction. Both need matplotlib (``pip install
"skafa[plot]"``).

The same is available as ``Attribution.to_html(path)`` /
``Attribution.to_png(path)`` and from the command line (``skafa report``).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

__all__ = ["attribution_html", "save_html", "plot_turn_scores", "plot_site_scores",
           "score_colour", "close_figure"]

#: Colours of the score scale, low to high (sRGB).
_LOW = (236, 241, 248)
_HIGH = (165, 15, 21)
#: Outline of the blamed turn; marker of the annotated turn.
BLAMED_COLOUR = "#d7301f"
ANNOTATED_COLOUR = "#1a9850"


def _unit(scores):
    """Scores min-max scaled to [0, 1] (all 0.5 when they are all equal)."""
    s = np.asarray(scores, dtype=np.float64)
    finite = np.isfinite(s)
    if not finite.any():
        return np.full(s.shape, 0.5)
    lo, hi = s[finite].min(), s[finite].max()
    out = np.full(s.shape, 0.5) if hi == lo else (s - lo) / (hi - lo)
    out[~finite] = 0.0
    return out


def score_colour(u) -> str:
    """Hex colour of a scaled score ``u`` in [0, 1] on the report's scale."""
    u = float(np.clip(u, 0.0, 1.0))
    rgb = [round(a + (b - a) * u) for a, b in zip(_LOW, _HIGH)]
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _esc(text) -> str:
    return html.escape("" if text is None else str(text), quote=True)


_CSS = f"""
:root {{ --blamed: {BLAMED_COLOUR}; --annotated: {ANNOTATED_COLOUR}; }}
* {{ box-sizing: border-box; }}
body {{ font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1b1f24;
       margin: 0 auto; max-width: 1100px; padding: 24px; background: #fafbfc; }}
h1 {{ font-size: 22px; margin: 0 0 4px; }}
h2 {{ font-size: 17px; margin: 28px 0 8px; }}
.meta {{ color: #57606a; font-size: 13px; }}
.cards {{ display: flex; gap: 16px; flex-wrap: wrap; margin: 16px 0; }}
.card {{ flex: 1 1 300px; background: #fff; border: 1px solid #d0d7de; border-radius: 8px;
        padding: 12px 16px; }}
.card.blame {{ border-left: 8px solid var(--blamed); }}
.card.truth {{ border-left: 8px solid var(--annotated); }}
.card .big {{ font-size: 20px; font-weight: 600; }}
.verdict {{ display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 13px;
           font-weight: 600; }}
.verdict.hit {{ background: #dafbe1; color: #116329; }}
.verdict.miss {{ background: #ffebe9; color: #a40e26; }}
table {{ border-collapse: collapse; background: #fff; }}
th, td {{ border: 1px solid #d0d7de; padding: 4px 10px; text-align: left; font-size: 14px; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
.task {{ background: #fff; border: 1px solid #d0d7de; border-radius: 8px; padding: 8px 16px; }}
.task pre {{ white-space: pre-wrap; word-wrap: break-word; }}
.turn {{ display: flex; background: #fff; border: 1px solid #d0d7de; border-radius: 6px;
        margin: 8px 0; overflow: hidden; }}
.turn .band {{ flex: 0 0 14px; }}
.turn .body {{ flex: 1; padding: 6px 12px; min-width: 0; }}
.turn .head {{ font-size: 13px; color: #57606a; }}
.turn .head b {{ color: #1b1f24; }}
.turn pre {{ white-space: pre-wrap; word-wrap: break-word; margin: 4px 0;
            font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; }}
.turn.blamed {{ outline: 4px solid var(--blamed); outline-offset: -1px;
               background: #fff5f3; }}
.turn.annotated {{ border: 3px dashed var(--annotated); }}
.badge {{ display: inline-block; padding: 0 7px; margin-left: 6px; border-radius: 9px;
         font-size: 12px; font-weight: 700; color: #fff; }}
.badge.blamed {{ background: var(--blamed); }}
.badge.annotated {{ background: var(--annotated); }}
.badge.rank {{ background: #6e7781; }}
.legend {{ font-size: 12px; color: #57606a; }}
.scale {{ display: inline-block; width: 160px; height: 10px; vertical-align: middle;
         background: linear-gradient(to right, {score_colour(0)}, {score_colour(1)});
         border: 1px solid #d0d7de; }}
svg text {{ font: 10px system-ui, sans-serif; fill: #57606a; }}
"""


def _strip_svg(scores, unit, step, true_step):
    """Inline SVG: one bar per turn, height and colour from the score."""
    n = len(scores)
    width, height, pad = 1000, 90, 14
    bar = max(1.0, (width - 2 * pad) / max(n, 1))
    parts = [f'<svg role="img" aria-label="turn scores" viewBox="0 0 {width} {height + 18}" '
             f'width="100%" xmlns="http://www.w3.org/2000/svg">']
    for t in range(n):
        h = 6 + (height - 10) * unit[t]
        x = pad + t * bar
        stroke = ""
        if t == step:
            stroke = f' stroke="{BLAMED_COLOUR}" stroke-width="3"'
        parts.append(f'<rect x="{x + 1:.1f}" y="{height - h:.1f}" width="{max(bar - 2, 1):.1f}" '
                     f'height="{h:.1f}" fill="{score_colour(unit[t])}"{stroke}>'
                     f'<title>turn {t}: score {scores[t]:+.3f}</title></rect>')
        if true_step is not None and t == true_step:
            cx = x + bar / 2
            parts.append(f'<polygon points="{cx - 5:.1f},{height + 12} {cx + 5:.1f},'
                         f'{height + 12} {cx:.1f},{height + 3}" fill="{ANNOTATED_COLOUR}">'
                         '<title>annotated decisive turn</title></polygon>')
        if n <= 60 or t % max(1, n // 30) == 0:
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{height + 16}" '
                         f'text-anchor="middle">{t}</text>')
    parts.append("</svg>")
    return "".join(parts)


def attribution_html(attribution, conversation=None, *, title=None) -> str:
    """Render an attribution as a self-contained HTML page.

    Parameters
    ----------
    attribution : Attribution
        From :meth:`skafa.FailureAttributor.attribute`.
    conversation : Conversation, default=None
        The conversation attributed, for the transcript. ``None`` uses the one
        the attribution carries (``attribution.conversation``); without either,
        the transcript lists speakers and scores only.
    title : str, default=None
        Page title; by default built from the record and task ids.

    Returns
    -------
    page : str
        The HTML document. Every turn is a ``<section class="turn" id="turn-<t>"
        data-score=...>``; the blamed turn also has class ``blamed`` and the
        annotated one class ``annotated``.
    """
    conv = conversation if conversation is not None else getattr(attribution, "conversation",
                                                                 None)
    scores = np.asarray(attribution.turn_scores, dtype=np.float64)
    proba = np.asarray(attribution.turn_probabilities, dtype=np.float64)
    n = scores.shape[0]
    if conv is not None and len(conv) != n:
        raise ValueError(f"the conversation has {len(conv)} turns but the attribution scored "
                         f"{n}; pass the conversation that was attributed.")
    speakers = list(attribution.speakers) if attribution.speakers else (
        list(conv.speakers) if conv is not None else ["?"] * n)
    unit = _unit(scores)
    step, true_step = int(attribution.step), attribution.true_step
    ranks = {r.step: k for k, r in enumerate(attribution.top_k, start=1)}
    ident = attribution.record_id or attribution.task_id
    title = title or ("skafa attribution" + (f": {ident}" if ident else ""))

    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
           'style-src \'unsafe-inline\'; img-src data:">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{_esc(title)}</h1>"]
    meta = [f"site <code>{_esc(attribution.site)}</code>", f"{n} turns"]
    if attribution.task_id:
        meta.append(f"task id <code>{_esc(attribution.task_id)}</code>")
    if attribution.record_id:
        meta.append(f"record <code>{_esc(attribution.record_id)}</code>")
    out.append(f'<div class="meta">{" · ".join(meta)}</div>')

    # summary cards
    out.append('<div class="cards">')
    out.append(f'<div class="card blame" id="blamed-summary"><div class="meta">Blamed by '
               f'the probe</div><div class="big"><a href="#turn-{step}">turn {step}</a> · '
               f'{_esc(attribution.agent)}</div><div class="meta">score '
               f'{scores[step]:+.3f} · probability {proba[step]:.3f}</div></div>')
    if true_step is not None:
        hit = int(true_step) == step
        verdict = ('<span class="verdict hit">found</span>' if hit else
                   f'<span class="verdict miss">missed by {abs(int(true_step) - step)} '
                   f'turn{"s" if abs(int(true_step) - step) != 1 else ""}</span>')
        out.append(f'<div class="card truth" id="annotated-summary"><div class="meta">'
                   f'Annotated decisive step</div><div class="big"><a href="#turn-{true_step}">'
                   f'turn {true_step}</a> · {_esc(attribution.true_agent)}</div>'
                   f'<div class="meta">{verdict} · its score {scores[int(true_step)]:+.3f}, '
                   f'rank {1 + int(np.sum(scores > scores[int(true_step)]))} of {n}</div></div>')
    else:
        out.append('<div class="card truth"><div class="meta">Annotated decisive step</div>'
                   '<div class="big">not known</div></div>')
    out.append("</div>")

    if conv is not None and (conv.task or conv.expected_answer):
        out.append('<h2>Task</h2><div class="task">')
        if conv.task:
            out.append(f"<pre>{_esc(conv.task)}</pre>")
        if conv.expected_answer:
            out.append(f'<div class="meta">expected answer: <b>{_esc(conv.expected_answer)}'
                       "</b></div>")
        out.append("</div>")

    # runner-ups
    out.append('<h2>Highest-scoring turns</h2><table id="runner-ups"><tr><th>rank</th>'
               "<th>turn</th><th>agent</th><th>score</th><th>probability</th>"
               "<th>preview</th></tr>")
    for k, r in enumerate(attribution.top_k, start=1):
        mark = " ✔" if true_step is not None and r.step == int(true_step) else ""
        out.append(f'<tr><td class="num">{k}</td><td class="num"><a href="#turn-{r.step}">'
                   f"{r.step}</a>{mark}</td><td>{_esc(r.agent)}</td>"
                   f'<td class="num">{r.score:+.3f}</td><td class="num">{r.probability:.3f}'
                   f"</td><td>{_esc(r.preview)}</td></tr>")
    out.append("</table>")

    out.append("<h2>Score of every turn</h2>")
    out.append(_strip_svg(scores, unit, step, true_step))
    out.append(f'<div class="legend">low <span class="scale"></span> high score · '
               f'<span style="color:{BLAMED_COLOUR}">■</span> blamed · '
               f'<span style="color:{ANNOTATED_COLOUR}">▲</span> annotated</div>')

    # transcript
    out.append("<h2>Transcript</h2>")
    for t in range(n):
        classes = ["turn"]
        badges = []
        if t == step:
            classes.append("blamed")
            badges.append('<span class="badge blamed">blamed</span>')
        if true_step is not None and t == int(true_step):
            classes.append("annotated")
            badges.append('<span class="badge annotated">annotated</span>')
        if t in ranks and t != step:
            badges.append(f'<span class="badge rank">#{ranks[t]}</span>')
        role = conv.turns[t].role if conv is not None else None
        role_txt = f" · {_esc(role)}" if role else ""
        body = (f"<pre>{_esc(conv.turns[t].content)}</pre>" if conv is not None
                else '<div class="meta">(text not available: pass the conversation)</div>')
        out.append(
            f'<section class="{" ".join(classes)}" id="turn-{t}" data-step="{t}" '
            f'data-score="{scores[t]:.6g}" data-probability="{proba[t]:.6g}">'
            f'<div class="band" style="background:{score_colour(unit[t])}" '
            f'title="score {scores[t]:+.3f}"></div><div class="body"><div class="head">'
            f"<b>turn {t} · {_esc(speakers[t])}</b>{role_txt} · score {scores[t]:+.3f} · "
            f"p {proba[t]:.3f}{''.join(badges)}</div>{body}</div></section>")
    out.append('<p class="meta">Made by skafa. Scores are a linear probe\'s reading of the '
               "language model's hidden state at each turn; the probe localizes a failure, "
               "it does not explain it.</p></body></html>")
    return "\n".join(out)


def save_html(attribution, path, conversation=None, *, title=None) -> Path:
    """Write :func:`attribution_html` to ``path`` (UTF-8); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(attribution_html(attribution, conversation, title=title), encoding="utf-8")
    return path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover
        raise ImportError("The PNG plots need matplotlib: pip install \"skafa[plot]\".") \
            from exc
    return plt


def close_figure(figure) -> None:
    """Close a figure made by the plots here (frees its memory in long runs)."""
    _pyplot().close(figure)


def plot_turn_scores(attribution, path=None, *, dpi=120):
    """Bar chart of the probe's score of every turn; blamed and annotated turns marked.

    Parameters
    ----------
    attribution : Attribution
    path : str or path-like, default=None
        Where to save the PNG; ``None`` only returns the figure.
    dpi : int, default=120

    Returns
    -------
    figure : matplotlib.figure.Figure
    """
    plt = _pyplot()
    scores = np.asarray(attribution.turn_scores, dtype=np.float64)
    n = scores.shape[0]
    unit = _unit(scores)
    step, true_step = int(attribution.step), attribution.true_step
    fig, ax = plt.subplots(figsize=(min(14, 3 + 0.35 * n), 3.6), dpi=dpi)
    colours = [score_colour(u) for u in unit]
    edges = [BLAMED_COLOUR if t == step else "#8c959f" for t in range(n)]
    widths = [2.5 if t == step else 0.5 for t in range(n)]
    ax.bar(np.arange(n), scores, color=colours, edgecolor=edges, linewidth=widths)
    if true_step is not None:
        ax.plot([int(true_step)], [scores[int(true_step)]], marker="v", color=ANNOTATED_COLOUR,
                markersize=11, linestyle="none", label=f"annotated: turn {true_step}")
    ax.plot([], [], color=BLAMED_COLOUR, linewidth=3,
            label=f"blamed: turn {step} ({attribution.agent})")
    ax.axhline(0, color="#8c959f", linewidth=0.6)
    speakers = list(attribution.speakers) or [""] * n
    if n <= 40:
        ax.set_xticks(np.arange(n))
        ax.set_xticklabels([f"{t} {s[:14]}" for t, s in enumerate(speakers)], rotation=60,
                           ha="right", fontsize=7)
    ax.set_xlabel("turn")
    ax.set_ylabel("probe score")
    ident = attribution.record_id or attribution.task_id or ""
    ax.set_title(f"Per-turn scores {ident} (site {attribution.site})".strip(), fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    return fig


def plot_site_scores(attributor, path=None, *, dpi=120):
    """Cross-validated step accuracy of the probe at every site the attributor compared.

    Reads ``attributor.cv_results_`` (mean and standard deviation over the
    inner folds of the site search); the chosen site(s) (``best_sites_``, else
    ``best_site_``) are marked. A joint search over sites and parameters
    (``SiteSelector(param_grid=...)``) gives one line per candidate, the chosen
    one drawn solid.

    Parameters
    ----------
    attributor : FailureAttributor or SiteSelector
        Fitted; anything with ``cv_results_`` holding ``site``,
        ``mean_test_score`` and ``std_test_score``.
    path : str or path-like, default=None
        Where to save the PNG; ``None`` only returns the figure.
    dpi : int, default=120

    Returns
    -------
    figure : matplotlib.figure.Figure
    """
    from sklearn.utils.validation import check_is_fitted

    check_is_fitted(attributor, "cv_results_")
    plt = _pyplot()
    res = attributor.cv_results_
    rows = [str(s) for s in res["site"]]
    mean = np.asarray(res["mean_test_score"], dtype=np.float64)
    std = np.asarray(res["std_test_score"], dtype=np.float64)
    # one line per candidate of a joint search (SiteSelector(param_grid=...)), else one
    params = list(res.get("params", [{}] * len(rows)))
    keys = [", ".join(f"{k}={v!r}" for k, v in sorted(p.items()) if k != "site")
            for p in params]
    candidates = list(dict.fromkeys(keys))
    sites = list(dict.fromkeys(rows))
    best_index = getattr(attributor, "best_index_", None)
    chosen_key = keys[best_index] if best_index is not None else candidates[0]
    chosen = tuple(getattr(attributor, "best_sites_", None)
                   or (getattr(attributor, "best_site_", None),))
    x = np.arange(len(sites))
    fig, ax = plt.subplots(figsize=(min(14, 3 + 0.3 * len(sites)), 3.6), dpi=dpi)
    colours = ["#0969da", "#8250df", "#1a7f37", "#9a6700", "#cf222e", "#57606a"]
    for j, key in enumerate(candidates):
        idx = [i for i, k in enumerate(keys) if k == key]
        xs = [sites.index(rows[i]) for i in idx]
        label = "mean ± sd over inner folds" + (f" ({key})" if key else "")
        ax.errorbar(xs, mean[idx], yerr=std[idx], fmt="o-", color=colours[j % len(colours)],
                    ecolor="#8c959f", capsize=2, markersize=4, label=label,
                    alpha=1.0 if key == chosen_key else 0.45)
    marked = [i for i, k in enumerate(keys) if k == chosen_key and rows[i] in chosen]
    if marked:
        what = "+".join(s for s in chosen if s is not None)
        ax.plot([sites.index(rows[i]) for i in marked], mean[marked], marker="*",
                markersize=15, color=BLAMED_COLOUR, linestyle="none",
                label=f"chosen: {what}" + (f" ({chosen_key})" if chosen_key else ""))
    ax.set_xticks(x)
    ax.set_xticklabels(sites, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("step accuracy (inner CV)")
    ax.set_title("Site search", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    return fig
