"""skafa.configurations: the pre-registered configurations 1-8, built by name."""

import numpy as np
import pytest
from sklearn.model_selection import GroupKFold

from skafa import (
    GroupedArgmaxLogisticClassifier,
    GroupedSoftmaxClassifier,
    SiteSelector,
    TurnActivationTransformer,
    TurnFeatureUnion,
    TurnPositionTransformer,
)
from skafa.attributor import FailureAttributor
from skafa.configurations import (
    PREREGISTERED_PROBES,
    RECOMMENDED,
    RECOMMENDED_FOR_READER,
    configuration_names,
    make_configuration,
    parse_configuration,
    recommended_configuration,
)


def test_the_27_names_in_the_preregistered_order():
    names = configuration_names()
    assert len(names) == 27 and len(set(names)) == 27
    assert names[0] == "last: logistic/single/acts"
    assert names[8] == "last: stack(probe, position, TF-IDF)"
    assert names[-1] == "echo: stack(probe, position, TF-IDF)"
    assert configuration_names(["recap"]) == names[9:18]


@pytest.mark.parametrize("name", [n for n in configuration_names() if "stack" not in n])
def test_every_configuration_builds_what_its_name_says(name):
    read, kind, Cs, n_sites, features = parse_configuration(name)
    extractor, selector = make_configuration(name, "some-model", cache_dir="/tmp/x")
    acts = extractor
    if features == "acts+pos":
        assert isinstance(extractor, TurnFeatureUnion)
        (n1, acts), (n2, pos) = extractor.transformer_list
        assert isinstance(pos, TurnPositionTransformer)
    assert isinstance(acts, TurnActivationTransformer)
    assert (acts.model, acts.read, acts.sites, acts.cache_dir) == (
        "some-model", read, "stride:3", "/tmp/x")
    assert isinstance(selector, SiteSelector)
    probe = {"logistic": GroupedArgmaxLogisticClassifier,
             "softmax": GroupedSoftmaxClassifier}[kind]
    assert type(selector.estimator) is probe
    assert selector.param_grid == {"C": list(Cs)} and selector.n_sites == n_sites
    assert isinstance(selector.cv, GroupKFold) and selector.cv.n_splits == 5


def test_bad_names_and_fixed_parameters_are_refused():
    with pytest.raises(ValueError, match="configuration 9"):
        make_configuration("last: stack(probe, position, TF-IDF)")
    with pytest.raises(ValueError, match="unknown configuration"):
        make_configuration("middle: logistic/single/acts")
    with pytest.raises(ValueError, match="unknown configuration"):
        make_configuration("last: logistic/top5/acts")
    with pytest.raises(ValueError, match=r"fixes \['read'\]"):
        make_configuration(RECOMMENDED, read="mean")


def test_the_benchmark_runs_these_definitions():
    from skafa.benchmarks import _who_and_when as bench
    from skafa.benchmarks import preregistered_names

    assert bench.PREREGISTERED_PROBES is PREREGISTERED_PROBES
    assert preregistered_names() == configuration_names()


def test_failure_attributor_defaults_are_the_recommended_configuration():
    extractor, selector = make_configuration(RECOMMENDED, "smollm2")
    pipe = FailureAttributor()._make_pipeline()
    got_x, got_s = pipe.named_steps["acts"], pipe.named_steps["select"]
    assert repr(got_x) == repr(extractor) and repr(got_s) == repr(selector)
    # a custom extractor keeps the recommended selector; a custom selector is used as is
    mine = TurnActivationTransformer("other", sites=["resid_final"])
    pipe = FailureAttributor(mine)._make_pipeline()
    assert pipe.named_steps["acts"].get_params() == mine.get_params()
    assert repr(pipe.named_steps["select"]) == repr(selector)
    own = SiteSelector(GroupedSoftmaxClassifier(C=3.0))
    pipe = FailureAttributor("other", own)._make_pipeline()
    assert pipe.named_steps["select"].estimator.C == 3.0
    assert pipe.named_steps["acts"].model == "other"


def test_recommended_configuration_fits_on_a_tiny_model():
    from skafa.llm import register_model, unregister_model
    from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

    name = "configurations-tiny"
    register_model(name, make_tiny_llama(n_layers=4, seed=1), make_tiny_tokenizer())
    convs = make_conversations(30, seed=2)
    try:
        fa = FailureAttributor(name).fit(convs)
    finally:
        unregister_model(name)
    sel = fa.pipeline_.named_steps["select"]
    assert fa.pipeline_.named_steps["acts"].sites_ == ("resid_pre.0", "resid_pre.3",
                                                       "resid_final")
    assert sel.best_params_["C"] in parse_configuration(RECOMMENDED)[2]
    assert len(sel.cv_results_["params"]) == 3 * len(parse_configuration(RECOMMENDED)[2])
    assert np.asarray(fa.predict(convs)).shape == (30,)


def test_a_reader_with_its_own_recommendation_gets_it():
    """Section 7's rule gave the 1.5B reader its own configuration: make_configuration,
    FailureAttributor and the CLI's 'recommended' build it for that reader only."""
    from skafa.cli import _make_attributor, build_parser

    assert RECOMMENDED_FOR_READER["qwen2.5-coder-1.5b"] != RECOMMENDED
    for model, want in (("qwen2.5-coder-1.5b", RECOMMENDED_FOR_READER["qwen2.5-coder-1.5b"]),
                        ("smollm2", RECOMMENDED), ("/models/qwen2.5-coder-1.5b.gguf",
                                                   RECOMMENDED)):
        assert recommended_configuration(model) == want
        extractor, selector = make_configuration(want, model)
        assert repr(make_configuration(model=model)) == repr((extractor, selector))
        pipe = FailureAttributor(model)._make_pipeline()
        assert repr(pipe.named_steps["acts"]) == repr(extractor)
        assert repr(pipe.named_steps["select"]) == repr(selector)
        # an extractor object of that model keeps that model's recommended selector
        pipe = FailureAttributor(clone_of(extractor))._make_pipeline()
        assert repr(pipe.named_steps["select"]) == repr(selector)
        args = build_parser().parse_args(["fit", "d.json", "--model", model, "--out", "p",
                                          "--configuration", "recommended", "-q"])
        cli = _make_attributor(args, verbose=0)
        assert cli.extractor.get_params()["model"] == model
        assert type(cli.selector.estimator) is type(selector.estimator)   # --seed set
        assert (cli.selector.n_sites, cli.selector.param_grid) == (selector.n_sites,
                                                                   selector.param_grid)
    assert recommended_configuration(None) == RECOMMENDED


def clone_of(estimator):
    from sklearn.base import clone

    return clone(estimator)
