"""Tests for skafa.report: the HTML attribution report (checked in headless Chromium) and PNGs."""

import html
import html.parser
import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from sklearn.model_selection import GroupKFold

from skafa import (
    Conversation,
    FailureAttributor,
    GroupedArgmaxLogisticClassifier,
    SiteSelector,
    Turn,
    TurnActivationTransformer,
)
from skafa.llm import register_model, unregister_model
from skafa.report import (
    BLAMED_COLOUR,
    attribution_html,
    plot_site_scores,
    plot_turn_scores,
    score_colour,
)
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

MODEL = "report-tiny"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def fitted():
    register_model(MODEL, make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    fa = FailureAttributor(
        TurnActivationTransformer(MODEL, sites=["resid_pre.1", "resid_final"]),
        SiteSelector(GroupedArgmaxLogisticClassifier(random_state=0), cv=GroupKFold(3)),
    ).fit(make_conversations(24, seed=5))
    yield fa
    unregister_model(MODEL)


@pytest.fixture(scope="module")
def attribution(fitted):
    """An attribution whose blamed turn differs from the annotated one, with hostile text."""
    for conv in make_conversations(20, seed=9, min_turns=4, max_turns=7):
        att = fitted.attribute(conv)
        if att.step != conv.mistake_step:
            break
    turns = list(conv.turns)
    turns[0] = Turn(turns[0].speaker, turns[0].content + ' <script>alert("x")</script> & <b>',
                    "assistant")
    conv = Conversation(turns, task=conv.task + " <i>", expected_answer=conv.expected_answer,
                        task_id=conv.task_id, mistake_step=conv.mistake_step,
                        mistake_agent=conv.mistake_agent, record_id=conv.record_id)
    return fitted.attribute(conv)


def _rgb(hex_colour):
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


# ----------------------------------------------------------------------- HTML
def test_page_structure(attribution):
    page = attribution.to_html()
    conv = attribution.conversation
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    sections = re.findall(r'<section class="([^"]*)" id="turn-(\d+)"', page)
    assert [int(t) for _, t in sections] == list(range(len(conv)))
    classes = {int(t): c.split() for c, t in sections}
    assert [t for t, c in classes.items() if "blamed" in c] == [attribution.step]
    assert [t for t, c in classes.items() if "annotated" in c] == [conv.mistake_step]
    # runner-ups table lists the top_k turns in order
    table = page.split('id="runner-ups"')[1].split("</table>")[0]
    assert re.findall(r'href="#turn-(\d+)"', table) == [str(r.step) for r in attribution.top_k]
    assert 'id="annotated-summary"' in page and "missed by" in page
    # every turn's text is there, escaped; nothing is executable or fetched
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &lt;b&gt;" in page
    assert "<script" not in page and "<i>" not in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert not re.search(r'(?:src|href)="(?!#)', page)
    for turn in conv.turns[1:]:
        assert html.escape(turn.content) in page
    # scores carried on the elements
    scores = [float(s) for s in re.findall(r'data-score="([^"]+)"', page)]
    np.testing.assert_allclose(scores, attribution.turn_scores, rtol=1e-5)


def test_to_html_writes_a_file_and_checks_the_conversation(attribution, tmp_path):
    path = attribution.to_html(tmp_path / "sub" / "r.html", title="My run")
    assert path.read_text(encoding="utf-8") == attribution.to_html(title="My run")
    assert "<title>My run</title>" in path.read_text(encoding="utf-8")
    other = make_conversations(1, seed=1, min_turns=1, max_turns=1)[0]
    with pytest.raises(ValueError, match="the conversation has 1 turns but the attribution"):
        attribution.to_html(conversation=other)


def test_page_without_conversation_or_labels(attribution):
    import dataclasses

    bare = dataclasses.replace(attribution, conversation=None, true_step=None, true_agent=None)
    page = attribution_html(bare)
    assert "text not available" in page and "not known" in page
    assert 'class="turn blamed"' in page and "annotated" not in page.split("<h2>Transcript")[1]


def test_score_colour_scale():
    assert score_colour(0) == "#ecf1f8" and score_colour(1) == "#a50f15"
    assert score_colour(2) == score_colour(1) and score_colour(-1) == score_colour(0)


# ------------------------------------------------------------------------ PNG
def test_pngs(attribution, fitted, tmp_path):
    path = attribution.to_png(tmp_path / "turns.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    fig = plot_turn_scores(attribution)
    ax = fig.axes[0]
    assert len(ax.patches) == attribution.n_turns
    heights = [p.get_height() for p in ax.patches]
    np.testing.assert_allclose(heights, attribution.turn_scores)
    blamed = ax.patches[attribution.step]
    assert blamed.get_linewidth() > ax.patches[(attribution.step + 1) % len(heights)] \
        .get_linewidth()
    fig2 = plot_site_scores(fitted, tmp_path / "sites.png")
    assert (tmp_path / "sites.png").read_bytes()[:8] == PNG_MAGIC
    labels = [t.get_text() for t in fig2.axes[0].get_xticklabels()]
    assert labels == ["resid_pre.1", "resid_final"]
    import matplotlib.pyplot as plt

    plt.close("all")


def test_site_plot_of_a_joint_search_has_one_line_per_candidate(fitted, tmp_path):
    import matplotlib.pyplot as plt

    from skafa import GroupedSoftmaxClassifier

    fa = FailureAttributor(
        TurnActivationTransformer(MODEL, sites=["resid_pre.0", "resid_pre.1", "resid_final"]),
        SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3), n_sites=2,
                     param_grid={"C": [0.1, 1.0]}),
    ).fit(make_conversations(24, seed=5))
    ax = plot_site_scores(fa, tmp_path / "joint.png").axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["resid_pre.0", "resid_pre.1",
                                                            "resid_final"]
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sum("C=" in t and t.startswith("mean") for t in texts) == 2
    chosen = [t for t in texts if t.startswith("chosen:")]
    assert chosen == [f"chosen: {'+'.join(fa.best_sites_)} (C={fa.best_params_['C']!r})"]
    star = [line for line in ax.get_lines() if line.get_marker() == "*"][0]
    assert len(star.get_xdata()) == 2
    plt.close("all")


# ------------------------------------------------------------------- Chromium
def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("Chromium is not installed (apt-get install chromium): the report is not "
                "checked in a real browser here; .ci/run installs it.")


def _run_chromium(binary, tmp_path, *args):
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update", "--no-first-run",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


_PROBE = """<script>
const rows = [...document.querySelectorAll('section.turn')].map(s => {
  const cs = getComputedStyle(s), r = s.getBoundingClientRect();
  return {id: s.id, outlineStyle: cs.outlineStyle, outlineColor: cs.outlineColor,
          outlineWidth: cs.outlineWidth, background: cs.backgroundColor,
          band: getComputedStyle(s.querySelector('.band')).backgroundColor,
          badges: [...s.querySelectorAll('.badge')].map(b => b.textContent),
          width: r.width, height: r.height};
});
const pre = document.createElement('pre'); pre.id = 'probe';
pre.textContent = JSON.stringify(rows); document.body.appendChild(pre);
</script></body>"""


def test_blamed_turn_is_highlighted_in_headless_chromium(attribution, tmp_path):
    binary = _chromium()
    page = attribution.to_html()
    # A copy with a measuring script: the report itself has none, and its CSP forbids one.
    probe_page = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page)
    probe_page = probe_page.replace("</body>", _PROBE)
    probe_file = tmp_path / "probe.html"
    probe_file.write_text(probe_page, encoding="utf-8")
    dom = _run_chromium(binary, tmp_path, "--dump-dom", probe_file.as_uri()).stdout
    match = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert match, "Chromium did not run the measuring script"
    rows = json.loads(html.unescape(match.group(1)))
    assert [r["id"] for r in rows] == [f"turn-{t}" for t in range(attribution.n_turns)]
    blamed_rgb = "rgb({}, {}, {})".format(*_rgb(BLAMED_COLOUR))
    for t, row in enumerate(rows):
        assert row["width"] > 100 and row["height"] > 10, row  # laid out, visible
        if t == attribution.step:
            assert row["outlineStyle"] == "solid" and row["outlineWidth"] == "4px"
            assert row["outlineColor"] == blamed_rgb
            assert "blamed" in row["badges"]
        else:
            assert row["outlineStyle"] == "none" and "blamed" not in row["badges"]
        if t == attribution.true_step:
            assert "annotated" in row["badges"]
    # the band of the highest-scoring turn (the blamed one) is the darkest colour
    top = int(np.argmax(attribution.turn_scores))
    assert top == attribution.step
    assert rows[top]["band"] == "rgb({}, {}, {})".format(*_rgb(score_colour(1.0)))

    # The real page (with its CSP) renders, and the highlight colour is on screen.
    real = tmp_path / "report.html"
    real.write_text(page, encoding="utf-8")
    shot = tmp_path / "shot.png"
    _run_chromium(binary, tmp_path, f"--screenshot={shot}", "--window-size=1200,4000",
                  "--hide-scrollbars", real.as_uri())
    import matplotlib.image

    pixels = (matplotlib.image.imread(shot)[..., :3] * 255).round().astype(int)
    target = np.array(_rgb(BLAMED_COLOUR))
    near = np.abs(pixels - target).max(axis=-1) <= 6
    assert near.sum() > 500, "the blamed highlight colour is not on the rendered page"


# ------------------------------------------------------- the debugging page
def _summary(page):
    """The top summary: from ``id="summary"`` to the score strip."""
    return page.split('id="summary"')[1].split('id="strip-panel"')[0]


def test_summary_at_the_top_names_blamed_runner_ups_and_annotated(attribution):
    page = attribution.to_html()
    speakers = attribution.speakers
    proba = attribution.turn_probabilities
    # the summary and the strip come first, before the task, the table and the transcript
    order = [page.index(k) for k in ('id="summary"', 'id="score-strip"', "<h2>Task",
                                     'id="runner-ups"', "<h2>Transcript")]
    assert order == sorted(order)
    summary = _summary(page)
    blamed = summary.split('id="blamed-summary"')[1].split('id="annotated-summary"')[0]
    assert f'<a href="#turn-{attribution.step}">turn {attribution.step}</a>' in blamed
    assert html.escape(attribution.agent) in blamed
    assert f"{attribution.probability:.3f}" in blamed
    # runner-ups: the next turns by descending probability, each with its probability
    runners = summary.split('id="runner-ups-summary"')[1]
    steps = [int(t) for t in re.findall(r'<li data-step="(\d+)">', runners)]
    expected = [t for t in np.argsort(-attribution.turn_scores, kind="stable")
                if t != attribution.step][:4]
    assert steps == expected and len(steps) == min(4, attribution.n_turns - 1)
    shown = [float(p) for p in re.findall(r'<span class="p">([0-9.]+)</span>', runners)]
    assert shown == sorted(shown, reverse=True)
    np.testing.assert_allclose(shown, proba[steps], atol=5e-4)
    assert shown[0] <= attribution.probability
    for t in steps:
        assert html.escape(speakers[t]) in runners.split(f'data-step="{t}"')[1].split("</li>")[0]
    # the annotated turn, and that the blame missed it
    truth = summary.split('id="annotated-summary"')[1].split('id="runner-ups-summary"')[0]
    t = attribution.true_step
    assert f'<a href="#turn-{t}">turn {t}</a>' in truth
    assert html.escape(attribution.true_agent) in truth
    assert f"missed by {abs(t - attribution.step)} turn" in truth


def test_summary_says_when_the_blame_hit_and_when_there_is_no_label(attribution):
    import dataclasses

    hit = dataclasses.replace(attribution, true_step=attribution.step,
                              true_agent=attribution.agent)
    truth = _summary(attribution_html(hit)).split('id="annotated-summary"')[1]
    assert "the blame hit it" in truth and "missed by" not in truth
    unknown = dataclasses.replace(attribution, true_step=None, true_agent=None)
    truth = _summary(attribution_html(unknown)).split('id="annotated-summary"')[1] \
        .split('id="runner-ups-summary"')[0]
    assert '<div class="big">none</div>' in truth and "not known" in truth
    assert "href" not in truth and "missed by" not in truth and "hit it" not in truth
    cells = re.findall(r'<a class="(cell[^"]*)"', attribution_html(unknown))
    assert len(cells) == attribution.n_turns and not [c for c in cells if "annotated" in c]


def test_score_strip_has_one_linked_cell_per_turn(attribution):
    page = attribution.to_html()
    strip = page.split('id="score-strip"')[1].split("</nav>")[0]
    cells = re.findall(r'<a class="(cell[^"]*)" href="#turn-(\d+)"[^>]*>'
                       r'<span class="bar" style="height:([0-9.]+)px;background:(#[0-9a-f]{6})',
                       strip)
    n = attribution.n_turns
    assert [int(t) for _, t, _, _ in cells] == list(range(n))
    assert len(re.findall(r"<a ", strip)) == n
    ids = set(re.findall(r'<section class="[^"]*" id="(turn-\d+)"', page))
    assert {f"turn-{t}" for _, t, _, _ in cells} == ids  # every link lands on a turn
    classes = [c.split() for c, _, _, _ in cells]
    assert [t for t, c in enumerate(classes) if "blamed" in c] == [attribution.step]
    assert [t for t, c in enumerate(classes) if "annotated" in c] == [attribution.true_step]
    # height and colour follow the score
    heights = np.array([float(h) for _, _, h, _ in cells])
    scores = attribution.turn_scores
    assert np.all(np.diff(heights[np.argsort(scores)]) >= 0)
    assert heights[np.argmax(scores)] > heights[np.argmin(scores)]
    assert cells[int(np.argmax(scores))][3] == score_colour(1.0)
    assert cells[int(np.argmin(scores))][3] == score_colour(0.0)


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.attrs = set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attrs.extend((tag, k, v or "") for k, v in attrs)

    handle_startendtag = handle_starttag


#: What the report itself writes; anything else would come from the data.
_REPORT_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "div", "code", "a",
                "span", "ol", "li", "nav", "table", "tr", "th", "td", "pre", "section", "b", "p"}
_HOSTILE = [
    '<script>alert(1)</script>', '"><script>alert(1)</script>', "'><img src=x onerror=alert(1)>",
    '<img src=x onerror="alert(1)">', '<svg onload=alert(1)>', '" onmouseover="alert(1)" x="',
    "' onfocus='alert(1)' autofocus='", '<a href="javascript:alert(1)">x</a>',
    '<iframe src="https://evil.example"></iframe>', '<style>body{display:none}</style>',
    '</pre></section><script>alert(1)</script>', '<!-- --><script>x</script>',
    '<body onload=alert(1)>', '<link rel=stylesheet href=//evil.example/x.css>',
    '<meta http-equiv="refresh" content="0;url=https://evil.example">', "&lt;b&gt; &amp;",
    '<object data="x.swf"></object>', "turn-0\" id=\"summary",
]


@pytest.mark.parametrize("payload", _HOSTILE)
def test_hostile_text_makes_no_tags_scripts_or_handlers(attribution, payload):
    import dataclasses

    conv = attribution.conversation
    turns = [Turn(payload + t.speaker, payload + t.content, t.role) for t in conv.turns]
    hostile = Conversation(turns, task=payload, expected_answer=payload, task_id=payload,
                           mistake_step=conv.mistake_step, mistake_agent=payload,
                           record_id=payload)
    att = dataclasses.replace(attribution, conversation=hostile, agent=payload, site=payload,
                              speakers=tuple(t.speaker for t in turns), true_agent=payload,
                              task_id=payload, record_id=payload)
    page = attribution_html(att)
    parser = _Tags()
    parser.feed(page)
    assert parser.tags <= _REPORT_TAGS, parser.tags - _REPORT_TAGS
    assert "<script" not in page.lower()
    assert not [a for a in parser.attrs if a[1].startswith("on")]
    assert all(v.startswith("#") for tag, k, v in parser.attrs if k in ("href", "src"))
    assert [v for tag, k, v in parser.attrs if k == "id"].count("summary") == 1
    assert all("url(" not in v for tag, k, v in parser.attrs if k == "style")
    assert html.escape(payload) in page


def test_page_has_no_script_and_no_event_handler_attributes(attribution):
    parser = _Tags()
    page = attribution.to_html()
    parser.feed(page)
    assert "script" not in parser.tags and "<script" not in page.lower()
    assert not [a for a in parser.attrs if a[1].startswith("on")]
    assert not re.search(r"<[a-z][^>]*\son[a-z]+\s*=", page, re.I)


_CLICK_PROBE = """<script>
window.addEventListener('load', () => setTimeout(() => {
const info = () => {
  const t = document.querySelector(':target'), panel = document.getElementById('strip-panel');
  return {hash: location.hash, target: t ? t.id : null,
          shadow: t ? getComputedStyle(t).boxShadow : null,
          top: t ? t.getBoundingClientRect().top : null, scrollY: window.scrollY,
          stripBottom: panel.getBoundingClientRect().bottom, height: window.innerHeight};
};
const cells = [...document.querySelectorAll('#score-strip a.cell')];
const out = {loaded: info(), cells: cells.map(a => {
  const r = a.getBoundingClientRect();
  return {hash: a.hash, lands: !!document.getElementById(a.hash.slice(1)), w: r.width, h: r.height};
})};
cells[CLICK].click();
out.clicked = info();
const pre = document.createElement('pre'); pre.id = 'probe';
pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
}, 100));
</script></body>"""


def test_strip_jumps_to_a_turn_in_headless_chromium(attribution, tmp_path):
    binary = _chromium()
    n, page = attribution.n_turns, attribution.to_html()
    load = attribution.true_step
    click = 0 if load != 0 else n - 1  # far from the loaded turn: the click must scroll
    args = ("--virtual-time-budget=2000", "--window-size=1200,500")
    # The real page (its CSP on): opened at #turn-K, the turn is there and nothing ran.
    real = tmp_path / "report.html"
    real.write_text(page, encoding="utf-8")
    dom = _run_chromium(binary, tmp_path, *args, "--dump-dom",
                        real.as_uri() + f"#turn-{load}").stdout
    assert f'id="turn-{load}"' in dom and "<script" not in dom
    # A copy with a measuring script that also clicks a bar of the strip.
    probe_page = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page)
    probe_page = probe_page.replace("</body>", _CLICK_PROBE.replace("CLICK", str(click)))
    probe = tmp_path / "probe.html"
    probe.write_text(probe_page, encoding="utf-8")
    dom = _run_chromium(binary, tmp_path, *args, "--dump-dom",
                        probe.as_uri() + f"#turn-{load}").stdout
    match = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert match, "Chromium did not run the measuring script"
    out = json.loads(html.unescape(match.group(1)))
    assert [c["hash"] for c in out["cells"]] == [f"#turn-{t}" for t in range(n)]
    assert all(c["lands"] and c["w"] >= 4 and c["h"] >= 20 for c in out["cells"]), out["cells"]
    for key, turn in (("loaded", load), ("clicked", click)):
        got = out[key]
        assert got["hash"] == f"#turn-{turn}" and got["target"] == f"turn-{turn}", got
        assert got["shadow"] not in (None, "none"), got  # the :target ring is drawn
        # in view, below the sticky strip (unless the page ends before it can scroll there)
        assert got["top"] < got["height"], got
        assert got["top"] >= got["stripBottom"] - 1 or got["scrollY"] == 0, got
    assert out["clicked"]["scrollY"] != out["loaded"]["scrollY"]


# ----------------------------------------------------------------- locator heads
def test_locator_heads_section_is_optional_inline_svg(attribution, tmp_path):
    from skafa.report import locator_heads_svg, plot_locator_heads, save_html

    acc = np.array([[0.1, 0.6, 0.2], [0.9, 0.0, 0.3]])
    page = attribution_html(attribution)
    assert 'id="locator-heads"' not in page
    page = attribution_html(attribution, locator_heads=(acc, 0.25))
    parser = _Tags()
    parser.feed(page)
    assert "script" not in parser.tags and 'id="locator-heads"' in page
    assert not [a for a in parser.attrs if a[1].startswith("on")]
    cells = re.findall(r'<rect class="head" data-layer="(\d+)" data-head="(\d+)" '
                       r'data-accuracy="([0-9.e-]+)"', page)
    assert [(int(a), int(b)) for a, b, _ in cells] == [(a, b) for a in range(2) for b in range(3)]
    np.testing.assert_allclose([float(v) for *_, v in cells], acc.ravel())
    assert "best L1 head 0: 0.900" in page and "chance 0.250" in page
    svg = locator_heads_svg(acc, layer_labels=["head_attn.0", "<b>"])
    assert "&lt;b&gt;" in svg and "<b>" not in svg
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        locator_heads_svg([[1.5]])
    with pytest.raises(ValueError, match="n_layers, n_heads"):
        locator_heads_svg([0.1, 0.2])
    path = save_html(attribution, tmp_path / "r.html", locator_heads=acc)
    assert 'id="locator-heads"' in path.read_text(encoding="utf-8")
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = plot_locator_heads(acc, tmp_path / "heads.png", chance=0.25)
    assert (tmp_path / "heads.png").read_bytes()[:8] == PNG_MAGIC
    plt.close(fig)


# -------------------------------------------------------------------- plot text
def test_dollar_in_speaker_names_plots():
    pytest.importorskip("matplotlib")
    from skafa.report import _plot_text

    assert _plot_text("a$b$c") == r"a\$b\$c"
    import matplotlib

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_title(_plot_text("$\\frac$ cost $5"))
    fig.savefig(io.BytesIO(), format="png")  # raises on unbalanced mathtext
    plt.close(fig)


def test_a_run_unlike_the_training_runs_gets_a_warning_card(attribution):
    import dataclasses

    plain = dataclasses.replace(attribution, shifted=False).to_html()
    assert 'id="shift-warning"' not in plain
    shifted = dataclasses.replace(attribution, shifted=True, shift_score=123.4)
    page = shifted.to_html()
    assert 'id="shift-warning"' in page and "looks unlike the training runs" in page
    assert "123" in page
