"""Attribution reports people can look at: a self-contained HTML page and PNG plots.

:func:`attribution_html` renders one :class:`~skafa.Attribution` as a single
HTML page meant for debugging a failed run: inline CSS, no JavaScript, no
network access (a Content-Security-Policy forbids both), so it opens the same
from a mail attachment, a CI artifact or a file share. At the top, without
scrolling, it shows

- the blamed turn and agent, with the probability of that turn;
- the annotated decisive turn and agent, when the conversation is labelled,
  and whether the blame hit it (or says there is no label);
- the runner-up turns by descending probability;
- a strip with one bar per turn (height and colour from the score, the blamed
  and annotated turns marked); each bar is a link to its turn, and the strip
  stays on screen (CSS ``position: sticky``) while the transcript scrolls.

Below come the task, the attribution's ``top_k`` turns with previews and the
transcript, each turn with a colour band for its score (pale: low, dark red:
high), the blamed turn outlined, the annotated turn marked, and the turn a link
jumped to ringed in blue (CSS ``:target``).

:func:`plot_turn_scores` draws the per-turn scores as a PNG;
:func:`plot_site_scores` draws a fitted attributor's cross-validated step
accuracy at every activation site it compared (``cv_results_``), the site
search behind the prediction. Both need matplotlib (``pip install
"skafa[plot]"``).

:func:`locator_heads_svg` draws per-head locator accuracy
(:func:`skafa.metrics.locator_head_accuracy`) as a layer x head heatmap, an
inline SVG fragment (no script) that :func:`attribution_html` can carry as an
optional section (``locator_heads=``); :func:`plot_locator_heads` draws the same
as a PNG.

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
           "score_colour", "close_figure", "locator_heads_svg", "plot_locator_heads"]

#: Colours of the score scale, low to high (sRGB).
_LOW = (236, 241, 248)
_HIGH = (165, 15, 21)
#: Outline of the blamed turn; marker of the annotated turn.
BLAMED_COLOUR = "#d7301f"
ANNOTATED_COLOUR = "#1a9850"
#: Ring around the turn a link jumped to (CSS ``:target``).
TARGET_COLOUR = "#0969da"


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
:root {{ --blamed: {BLAMED_COLOUR}; --annotated: {ANNOTATED_COLOUR}; --target: {TARGET_COLOUR};
         --line: #d0d7de; --muted: #57606a; }}
* {{ box-sizing: border-box; }}
html {{ scroll-behavior: auto; }}
body {{ font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1b1f24;
       margin: 0 auto; max-width: 1120px; padding: 16px 24px 40px; background: #fafbfc; }}
a {{ color: #0969da; }}
h1 {{ font-size: 20px; margin: 0 0 2px; overflow-wrap: anywhere; }}
h2 {{ font-size: 16px; margin: 24px 0 8px; }}
.meta {{ color: var(--muted); font-size: 13px; overflow-wrap: anywhere; }}
.summary {{ display: grid; grid-template-columns: 1.15fr 1fr 1.25fr; gap: 12px; margin: 12px 0 0; }}
@media (max-width: 760px) {{ .summary {{ grid-template-columns: 1fr; }} }}
.card {{ background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px;
        min-width: 0; }}
.card.blame {{ border-left: 8px solid var(--blamed); }}
.card.truth {{ border-left: 8px solid var(--annotated); }}
.card.truth.unknown {{ border-left-color: #afb8c1; }}
.card .label {{ font-size: 12px; font-weight: 700; letter-spacing: .04em; text-transform: uppercase;
               color: var(--muted); }}
.card .big {{ font-size: 19px; font-weight: 650; margin: 2px 0; overflow-wrap: anywhere; }}
.card .big a {{ color: inherit; }}
.card .prob {{ font-size: 14px; }}
.card .prob b {{ font-size: 18px; font-variant-numeric: tabular-nums; }}
.card .preview {{ font: 12px/1.35 ui-monospace, SFMono-Regular, Menlo, monospace; color: #424a53;
                 margin-top: 6px; max-height: 3.1em; overflow: hidden; overflow-wrap: anywhere; }}
.pbar {{ display: inline-block; width: 70px; height: 8px; background: #eaeef2; border-radius: 4px;
        vertical-align: middle; overflow: hidden; }}
.pbar > span {{ display: block; height: 100%; background: #6e7781; }}
ol.runner-ups {{ margin: 4px 0 0; padding: 0; list-style: none; font-size: 14px; }}
ol.runner-ups li {{ display: grid; grid-template-columns: 26px 1fr auto 60px; gap: 6px;
                   align-items: baseline; padding: 1px 0; }}
ol.runner-ups .rank {{ color: var(--muted); font-variant-numeric: tabular-nums; }}
ol.runner-ups .who {{ min-width: 0; overflow-wrap: anywhere; }}
ol.runner-ups .p {{ font-variant-numeric: tabular-nums; text-align: right; }}
.verdict {{ display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 13px;
           font-weight: 600; }}
.verdict.hit {{ background: #dafbe1; color: #116329; }}
.verdict.miss {{ background: #ffebe9; color: #a40e26; }}
.tick {{ color: var(--annotated); font-weight: 700; white-space: nowrap; }}
.strip-panel {{ position: sticky; top: 0; z-index: 3; background: #fafbfc; margin: 0 -8px;
               padding: 10px 8px 6px; border-bottom: 1px solid var(--line); }}
.strip-panel .title {{ font-size: 12px; font-weight: 700; letter-spacing: .04em;
                      text-transform: uppercase; color: var(--muted); }}
.strip {{ display: flex; flex-wrap: wrap; gap: 2px; margin-top: 4px; }}
.strip .cell {{ flex: 1 1 0; min-width: 5px; max-width: 56px; height: 62px; display: flex;
               flex-direction: column; justify-content: flex-end; text-decoration: none;
               border-radius: 3px; border-bottom: 4px solid transparent; }}
.strip .cell:hover {{ background: #eaeef2; }}
.strip .cell:focus-visible {{ outline: 2px solid var(--target); }}
.strip .bar {{ display: block; width: 100%; border-radius: 2px 2px 0 0; min-height: 4px; }}
.strip .cell.blamed .bar {{ box-shadow: inset 0 0 0 2px var(--blamed), 0 0 0 1px var(--blamed); }}
.strip .cell.annotated {{ border-bottom-color: var(--annotated); }}
.strip .idx {{ display: block; height: 14px; font-size: 10px; line-height: 14px; color: var(--muted);
              text-align: center; overflow: visible; white-space: nowrap; }}
.legend {{ font-size: 12px; color: var(--muted); margin-top: 3px; }}
.scale {{ display: inline-block; width: 120px; height: 9px; vertical-align: middle;
         background: linear-gradient(to right, {score_colour(0)}, {score_colour(1)});
         border: 1px solid var(--line); }}
.key {{ display: inline-block; width: 12px; height: 9px; vertical-align: middle; }}
table {{ border-collapse: collapse; background: #fff; width: 100%; table-layout: auto; }}
th, td {{ border: 1px solid var(--line); padding: 4px 10px; text-align: left; font-size: 14px; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }}
td.preview {{ overflow-wrap: anywhere; }}
.task {{ background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 8px 16px; }}
.task pre {{ white-space: pre-wrap; overflow-wrap: anywhere; max-height: 16em; overflow: auto; }}
.turn {{ display: flex; background: #fff; border: 1px solid var(--line); border-radius: 6px;
        margin: 8px 0; overflow: hidden; scroll-margin-top: 132px; }}
.turn .band {{ flex: 0 0 14px; }}
.turn .body {{ flex: 1; padding: 6px 12px; min-width: 0; }}
.turn .head {{ font-size: 13px; color: var(--muted); overflow-wrap: anywhere; }}
.turn .head b {{ color: #1b1f24; }}
.turn .head a.up {{ float: right; font-size: 12px; text-decoration: none; }}
.turn pre {{ white-space: pre-wrap; overflow-wrap: anywhere; margin: 4px 0;
            font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; }}
.turn.blamed {{ outline: 4px solid var(--blamed); outline-offset: -1px; background: #fff5f3; }}
.turn.annotated {{ border: 3px dashed var(--annotated); }}
.turn:target {{ box-shadow: 0 0 0 4px var(--target), 0 6px 18px rgba(9, 105, 218, .30); }}
.turn:target .head {{ color: #1b1f24; }}
.turn:target .head::after {{ content: "you jumped here"; margin-left: 8px; padding: 0 7px;
                            border-radius: 9px; font-size: 12px; font-weight: 700; color: #fff;
                            background: var(--target); }}
.badge {{ display: inline-block; padding: 0 7px; margin-left: 6px; border-radius: 9px;
         font-size: 12px; font-weight: 700; color: #fff; }}
.badge.blamed {{ background: var(--blamed); }}
.badge.annotated {{ background: var(--annotated); }}
.badge.rank {{ background: #6e7781; }}
"""

#: Turns in the summary's ranking: the blamed one and up to four runner-ups.
N_RANKED = 5


def _ranking(scores):
    """Turn indices by descending score, earliest first on ties (as ``attribute`` ranks)."""
    return [int(t) for t in np.argsort(-scores, kind="stable")]


def _pbar(p):
    return (f'<span class="pbar"><span style="width:{100 * float(np.clip(p, 0, 1)):.1f}%">'
            "</span></span>")


def _score_strip(scores, proba, unit, speakers, step, true_step):
    """HTML strip: one link per turn (``href="#turn-<t>"``), bar height and colour from the score."""
    n = len(scores)
    label_every = 1 if n <= 40 else -(-n // 30)
    cells = []
    for t in range(n):
        classes = ["cell"]
        if t == step:
            classes.append("blamed")
        if true_step is not None and t == true_step:
            classes.append("annotated")
        tip = (f"turn {t} · {speakers[t]} · score {scores[t]:+.3f} · p {proba[t]:.3f}"
               + (" · blamed" if t == step else "")
               + (" · annotated" if true_step is not None and t == true_step else ""))
        label = str(t) if t % label_every == 0 else ""
        cells.append(f'<a class="{" ".join(classes)}" href="#turn-{t}" title="{_esc(tip)}">'
                     f'<span class="bar" style="height:{8 + 40 * unit[t]:.1f}px;'
                     f'background:{score_colour(unit[t])}"></span>'
                     f'<span class="idx">{label}</span></a>')
    return ('<nav class="strip-panel" id="strip-panel" aria-label="score of every turn">'
            '<div class="title">Score of every turn · click a bar to jump to the turn</div>'
            f'<div class="strip" id="score-strip">{"".join(cells)}</div>'
            '<div class="legend">low <span class="scale"></span> high score · '
            '<span class="key" style="box-shadow: inset 0 0 0 2px var(--blamed)"></span> blamed · '
            '<span class="key" style="border-bottom: 4px solid var(--annotated)"></span> '
            'annotated · hover a bar for its speaker, score and probability</div></nav>')


def attribution_html(attribution, conversation=None, *, title=None,
                     locator_heads=None) -> str:
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
    locator_heads : array-like or (array-like, float), default=None
        Per-head locator accuracy ``(n_layers, n_heads)``, optionally with its
        chance level (what :func:`skafa.metrics.locator_head_accuracy` returns):
        adds a "Locator heads" section (``id="locator-heads"``) with
        :func:`locator_heads_svg`. ``None``: no such section.

    Returns
    -------
    page : str
        The HTML document. At the top, ``id="summary"``: the blamed turn
        (``id="blamed-summary"``), the annotated turn (``id="annotated-summary"``)
        and the runner-ups by descending probability (``id="runner-ups-summary"``);
        below it the score strip (``id="score-strip"``), one ``<a class="cell"
        href="#turn-<t>">`` per turn. Every turn is a ``<section class="turn"
        id="turn-<t>" data-score=...>``; the blamed turn also has class ``blamed``
        and the annotated one class ``annotated``.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa.attributor import Attribution
    >>> att = Attribution(step=1, agent="Coder", turn_scores=np.array([0.1, 2.0, 0.5]),
    ...                   turn_probabilities=np.array([0.12, 0.72, 0.16]), site="resid_final",
    ...                   speakers=("Planner", "Coder", "<b>Verifier</b>"), true_step=2)
    >>> page = attribution_html(att)
    >>> page.count('class="cell'), "<b>Verifier" in page, "&lt;b&gt;Verifier" in page
    (3, False, True)
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
    step = int(attribution.step)
    true_step = None if attribution.true_step is None else int(attribution.true_step)
    ranks = {r.step: k for k, r in enumerate(attribution.top_k, start=1)}
    order = _ranking(scores)
    ident = attribution.record_id or attribution.task_id
    title = title or ("skafa attribution" + (f": {ident}" if ident else ""))

    def preview(t):
        for r in attribution.top_k:
            if r.step == t and r.preview:
                return r.preview
        if conv is not None:
            text = " ".join(str(conv.turns[t].content).split())
            return text[:157] + "…" if len(text) > 160 else text
        return ""

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
    if getattr(attribution, "shifted", None):
        out.append('<div class="card shift" id="shift-warning" role="alert" '
                   'style="border-left:4px solid #b45309;background:#fffbeb;margin:8px 0">'
                   '<div class="label">This run looks unlike the training runs</div>'
                   f'<div class="meta">shift score {float(attribution.shift_score):.3g}, '
                   "outside the central 95% of held-out training runs' scores. A probe "
                   "trained on another framework's runs scores near chance: treat this "
                   "blame as a guess, label some runs of this framework "
                   "(<code>skafa label</code>) and refit.</div></div>")

    # summary: blamed turn, annotated turn, runner-ups
    out.append('<div class="summary" id="summary">')
    out.append(f'<div class="card blame" id="blamed-summary"><div class="label">Blamed turn</div>'
               f'<div class="big"><a href="#turn-{step}">turn {step}</a> · '
               f'{_esc(attribution.agent)}</div><div class="prob">probability '
               f'<b>{proba[step]:.3f}</b></div><div class="meta">score {scores[step]:+.3f} · '
               f'rank 1 of {n} · a uniform guess would give {1 / n:.3f}</div>'
               f'<div class="preview">{_esc(preview(step))}</div></div>')
    if true_step is not None:
        shift = abs(true_step - step)
        verdict = ('<span class="verdict hit">the blame hit it</span>' if shift == 0 else
                   f'<span class="verdict miss">missed by {shift} turn{"s" if shift != 1 else ""}'
                   "</span>")
        out.append(f'<div class="card truth" id="annotated-summary"><div class="label">'
                   f'Annotated turn (the label)</div><div class="big"><a href="#turn-{true_step}">'
                   f'turn {true_step}</a> · {_esc(attribution.true_agent)}</div>'
                   f'<div class="prob">{verdict}</div><div class="meta">its probability '
                   f'{proba[true_step]:.3f} · score {scores[true_step]:+.3f} · rank '
                   f'{order.index(true_step) + 1} of {n}</div></div>')
    else:
        out.append('<div class="card truth unknown" id="annotated-summary"><div class="label">'
                   'Annotated turn (the label)</div><div class="big">none</div>'
                   '<div class="meta">not known: the conversation carries no label, so the '
                   "blame cannot be checked here</div></div>")
    runners = [t for t in order if t != step][:N_RANKED - 1]
    items = []
    for k, t in enumerate(runners, start=2):
        tick = (' <span class="tick" title="the annotated turn">✔ annotated</span>'
                if t == true_step else "")
        items.append(f'<li data-step="{t}"><span class="rank">#{k}</span><span class="who">'
                     f'<a href="#turn-{t}">turn {t}</a> · {_esc(speakers[t])}{tick}</span>'
                     f'<span class="p">{proba[t]:.3f}</span>{_pbar(proba[t] / proba[step])}</li>')
    out.append('<div class="card runners" id="runner-ups-summary"><div class="label">Runner-ups '
               '· probability <span title="bars: probability relative to the blamed turn">'
               '(bar: vs blamed)</span></div>'
               + (f'<ol class="runner-ups">{"".join(items)}</ol>' if items else
                  '<div class="meta">none: the conversation has one turn</div>')
               + "</div></div>")

    out.append(_score_strip(scores, proba, unit, speakers, step, true_step))

    if conv is not None and (conv.task or conv.expected_answer):
        out.append('<h2>Task</h2><div class="task">')
        if conv.task:
            out.append(f"<pre>{_esc(conv.task)}</pre>")
        if conv.expected_answer:
            out.append(f'<div class="meta">expected answer: <b>{_esc(conv.expected_answer)}'
                       "</b></div>")
        out.append("</div>")

    # the attribution's top_k with previews
    out.append('<h2>Highest-scoring turns</h2><table id="runner-ups"><tr><th>rank</th>'
               "<th>turn</th><th>agent</th><th>score</th><th>probability</th>"
               "<th>preview</th></tr>")
    for k, r in enumerate(attribution.top_k, start=1):
        mark = " ✔" if true_step is not None and r.step == true_step else ""
        out.append(f'<tr><td class="num">{k}</td><td class="num"><a href="#turn-{r.step}">'
                   f"{r.step}</a>{mark}</td><td>{_esc(r.agent)}</td>"
                   f'<td class="num">{r.score:+.3f}</td><td class="num">{r.probability:.3f}'
                   f'</td><td class="preview">{_esc(r.preview)}</td></tr>')
    out.append("</table>")

    # transcript
    out.append("<h2>Transcript</h2>")
    for t in range(n):
        classes = ["turn"]
        badges = []
        if t == step:
            classes.append("blamed")
            badges.append('<span class="badge blamed">blamed</span>')
        if true_step is not None and t == true_step:
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
            f'<a class="up" href="#summary">↑ summary</a>'
            f"<b>turn {t} · {_esc(speakers[t])}</b>{role_txt} · score {scores[t]:+.3f} · "
            f"p {proba[t]:.3f}{''.join(badges)}</div>{body}</div></section>")
    if locator_heads is not None:
        accuracy, chance = _accuracy_and_chance(locator_heads)
        out.append('<h2>Locator heads</h2><div class="locator-heads" id="locator-heads">'
                   '<div class="meta">share of labelled runs whose most-attended turn, from the '
                   "answer position, is the decisive one, per layer and head</div>"
                   f"{locator_heads_svg(accuracy, chance=chance)}</div>")
    out.append('<p class="meta">Made by skafa. Scores are a linear probe\'s reading of the '
               "language model's hidden state at each turn; the probe localizes a failure, "
               "it does not explain it.</p></body></html>")
    return "\n".join(out)


def save_html(attribution, path, conversation=None, *, title=None,
              locator_heads=None) -> Path:
    """Write :func:`attribution_html` to ``path`` (UTF-8); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(attribution_html(attribution, conversation, title=title,
                                     locator_heads=locator_heads), encoding="utf-8")
    return path


def _accuracy_and_chance(locator_heads):
    """``(accuracy, chance)`` from an array or an ``(array, chance)`` pair."""
    if isinstance(locator_heads, tuple) and len(locator_heads) == 2 and np.ndim(
            locator_heads[1]) == 0:
        return locator_heads[0], float(locator_heads[1])
    return locator_heads, None


def _check_accuracy(accuracy):
    acc = np.asarray(accuracy, dtype=np.float64)
    if acc.ndim != 2 or 0 in acc.shape:
        raise ValueError(f"the locator accuracy must be a non-empty (n_layers, n_heads) array, "
                         f"got shape {acc.shape}.")
    if not np.isfinite(acc).all() or acc.min() < 0 or acc.max() > 1:
        raise ValueError("the locator accuracy must hold shares in [0, 1].")
    return acc


def locator_heads_svg(accuracy, *, chance=None, cell=18, layer_labels=None) -> str:
    """Per-head locator accuracy as a layer x head heatmap: an inline SVG fragment.

    Parameters
    ----------
    accuracy : array-like of shape (n_layers, n_heads)
        Shares in ``[0, 1]``, e.g. from :func:`skafa.metrics.locator_head_accuracy`.
    chance : float, default=None
        The chance level, named in the caption; cells above it get a dark outline.
    cell : int, default=18
        Side of one cell in pixels.
    layer_labels : sequence of str, default=None
        Row labels (e.g. the site names); ``None``: ``L0``, ``L1``, ...

    Returns
    -------
    svg : str
        An ``<svg>`` element (no script, no external reference) with one ``<rect
        class="head" data-layer=... data-head=... data-accuracy=...>`` per head,
        each with a ``<title>`` tooltip; colours on the report's score scale
        (0 pale, 1 dark red).

    Examples
    --------
    >>> svg = locator_heads_svg([[0.1, 0.5], [0.9, 0.2]], chance=0.25)
    >>> svg.startswith("<svg"), svg.count('class="head"'), "<script" in svg
    (True, 4, False)
    """
    acc = _check_accuracy(accuracy)
    n_layers, n_heads = acc.shape
    cell = int(cell)
    labels = ([f"L{k}" for k in range(n_layers)] if layer_labels is None
              else [str(s) for s in layer_labels])
    if len(labels) != n_layers:
        raise ValueError(f"layer_labels has {len(labels)} names for {n_layers} layers.")
    left = 8 + 7 * max(len(s) for s in labels)
    top = 18
    width = max(left + n_heads * cell + 8, 360)  # room for the caption
    height = top + n_layers * cell + 34
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="locator-heatmap" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="locator accuracy per layer and head" font-family="sans-serif" '
           f'font-size="10">']
    for h in range(n_heads):
        if n_heads <= 32 or h % 4 == 0:
            out.append(f'<text x="{left + h * cell + cell / 2:.1f}" y="{top - 5}" '
                       f'text-anchor="middle">{h}</text>')
    for layer in range(n_layers):
        y = top + layer * cell
        out.append(f'<text x="{left - 4}" y="{y + cell / 2 + 3.5:.1f}" text-anchor="end">'
                   f"{_esc(labels[layer])}</text>")
        for h in range(n_heads):
            a = acc[layer, h]
            above = chance is not None and a > chance
            stroke = ' stroke="#24292f" stroke-width="1.5"' if above else ' stroke="#ffffff"'
            out.append(f'<rect class="head" data-layer="{layer}" data-head="{h}" '
                       f'data-accuracy="{a:.6g}" x="{left + h * cell}" y="{y}" width="{cell}" '
                       f'height="{cell}" fill="{score_colour(a)}"{stroke}><title>'
                       f"{_esc(labels[layer])} head {h}: {a:.3f}</title></rect>")
    best = np.unravel_index(int(np.argmax(acc)), acc.shape)
    caption = (f"head → · best {_esc(labels[best[0]])} head {best[1]}: "
               f"{acc[best]:.3f}")
    if chance is not None:
        caption += f" · chance {float(chance):.3f} (outlined: above it)"
    out.append(f'<text x="{left}" y="{top + n_layers * cell + 14}">{caption}</text>')
    out.append(f'<text x="{left}" y="{top + n_layers * cell + 28}">0 pale · 1 dark red</text>')
    out.append("</svg>")
    return "".join(out)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover
        raise ImportError("The PNG plots need matplotlib: pip install \"skafa[plot]\".") \
            from exc
    return plt


def _plot_text(text) -> str:
    """Text shown literally in a matplotlib figure: ``$`` would start mathtext.

    A speaker named ``$x$`` would be typeset as math, and ``a$b`` (one dollar)
    or ``$\\frac$`` makes ``savefig`` raise; ``\\$`` is a literal dollar.
    """
    return str(text).replace("$", r"\$")


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
            label=_plot_text(f"blamed: turn {step} ({attribution.agent})"))
    ax.axhline(0, color="#8c959f", linewidth=0.6)
    speakers = list(attribution.speakers) or [""] * n
    if n <= 40:
        ax.set_xticks(np.arange(n))
        ax.set_xticklabels([_plot_text(f"{t} {s[:14]}") for t, s in enumerate(speakers)],
                           rotation=60,
                           ha="right", fontsize=7)
    ax.set_xlabel("turn")
    ax.set_ylabel("probe score")
    ident = attribution.record_id or attribution.task_id or ""
    ax.set_title(_plot_text(f"Per-turn scores {ident} (site {attribution.site})".strip()),
                 fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    return fig


def plot_locator_heads(accuracy, path=None, *, chance=None, layer_labels=None, dpi=120):
    """Per-head locator accuracy as a layer x head heatmap (PNG).

    Parameters
    ----------
    accuracy : array-like of shape (n_layers, n_heads)
        From :func:`skafa.metrics.locator_head_accuracy`.
    path : str or path-like, default=None
        Where to save the PNG; ``None`` only returns the figure.
    chance : float, default=None
        The chance level, named in the title; heads above it are dotted.
    layer_labels : sequence of str, default=None
        Row labels; ``None``: the layer index.
    dpi : int, default=120

    Returns
    -------
    figure : matplotlib.figure.Figure
    """
    acc = _check_accuracy(accuracy)
    plt = _pyplot()
    from matplotlib.colors import LinearSegmentedColormap

    n_layers, n_heads = acc.shape
    cmap = LinearSegmentedColormap.from_list(
        "skafa_score", [tuple(c / 255 for c in _LOW), tuple(c / 255 for c in _HIGH)])
    fig, ax = plt.subplots(figsize=(min(14, 2.8 + 0.3 * n_heads), min(14, 1.8 + 0.2 * n_layers)),
                           dpi=dpi)
    image = ax.imshow(acc, cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    if chance is not None:
        rows, cols = np.nonzero(acc > chance)
        ax.plot(cols, rows, linestyle="none", marker=".", color="#24292f", markersize=3)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    if layer_labels is not None:
        ax.set_yticks(np.arange(n_layers))
        ax.set_yticklabels([_plot_text(s) for s in layer_labels], fontsize=7)
    fig.colorbar(image, ax=ax, label="locator accuracy")
    title = "Locator heads"
    if chance is not None:
        title += f" (chance {float(chance):.3f}; dots: above it)"
    ax.set_title(title, fontsize=10)
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
                    ecolor="#8c959f", capsize=2, markersize=4, label=_plot_text(label),
                    alpha=1.0 if key == chosen_key else 0.45)
    marked = [i for i, k in enumerate(keys) if k == chosen_key and rows[i] in chosen]
    if marked:
        what = "+".join(s for s in chosen if s is not None)
        ax.plot([sites.index(rows[i]) for i in marked], mean[marked], marker="*",
                markersize=15, color=BLAMED_COLOUR, linestyle="none",
                label=_plot_text(f"chosen: {what}" + (f" ({chosen_key})" if chosen_key else "")))
    ax.set_xticks(x)
    ax.set_xticklabels([_plot_text(s) for s in sites], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("step accuracy (inner CV)")
    ax.set_title("Site search", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    return fig
