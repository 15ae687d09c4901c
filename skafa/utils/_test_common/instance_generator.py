"""Instances of every public estimator for the shared estimator checks.

One place, as scikit-learn's ``utils/_test_common/instance_generator.py``: production
classes carry no test scaffolding. An estimator that :func:`estimator_instances` cannot
build with ``cls()`` gets an entry here.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from skafa import (
    AttributionPipeline,
    FailureAttributor,
    GraftedJudge,
    GroupedArgmaxLogisticClassifier,
    OnlineAuditor,
    PerTurn,
    PromptedJudge,
    ShiftDetector,
    SiteConcatenator,
    SiteEnsemble,
    SiteSelector,
    TurnActivationTransformer,
    TurnFeatureUnion,
    TurnScoreStacker,
)

__all__ = ["INSTANCE_FACTORIES"]


def _turn_activation_transformer():
    from skafa.testing import register_tiny_model

    return [
        TurnActivationTransformer(
            register_tiny_model(), sites=["resid_pre.1", "resid_final"]
        ),
        TurnActivationTransformer(
            register_tiny_model(), sites=["mlp_in.0"], read="mean", batch_size=3
        ),
    ]


def _per_turn():
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import StandardScaler

    return [PerTurn(StandardScaler()), PerTurn(PCA(n_components=2))]


def _turn_feature_union():
    from skafa.featurizers import TurnPositionTransformer, TurnTextTransformer

    return [
        TurnFeatureUnion(
            [
                ("pos", TurnPositionTransformer(include=["relative", "speaker"])),
                ("text", TurnTextTransformer()),
            ]
        )
    ]


def _site_concatenator():
    return [SiteConcatenator("features")]  # the one block of a 2-D TurnFeatures


def _attribution_pipeline():
    from skafa.featurizers import TurnPositionTransformer
    from skafa.probes import GroupedArgmaxLogisticClassifier

    return [
        AttributionPipeline(
            [
                ("pos", TurnPositionTransformer()),
                ("probe", GroupedArgmaxLogisticClassifier()),
            ]
        )
    ]


def _failure_attributor():
    from skafa.testing import register_tiny_model

    return [
        FailureAttributor(
            TurnActivationTransformer(
                register_tiny_model(), sites=["resid_pre.1", "resid_final"]
            ),
            SiteSelector(GroupedArgmaxLogisticClassifier(random_state=0), cv=3),
        )
    ]


def _online_auditor():
    return [
        OnlineAuditor(cv=2, random_state=0),
        OnlineAuditor(target="hazard", cv=2, random_state=0),
    ]


def _prompted_judge():
    from skafa.testing import register_tiny_model

    return [
        PromptedJudge(register_tiny_model()),
        PromptedJudge(register_tiny_model(), mode="generate", max_new_tokens=2),
        # the strategies that ask several questions per run (threshold fitted on y)
        PromptedJudge(register_tiny_model(), strategy="step_by_step", yes_threshold="fit"),
        PromptedJudge(register_tiny_model(), strategy="binary_search"),
        PromptedJudge(register_tiny_model(), strategy="sequential"),
    ]


def _grafted_judge():
    from skafa.testing import register_tiny_model

    # small grids: one fit ranks the heads and compares two pairs on two inner folds
    return [GraftedJudge(register_tiny_model(), locator_grid=(1,), writer_grid=(0, 1), cv=2)]


def _turn_score_stacker():
    from sklearn.model_selection import GroupKFold

    from skafa.compose import make_attribution_pipeline
    from skafa.featurizers import TurnPositionTransformer, TurnTextTransformer
    from skafa.probes import GroupedArgmaxLogisticClassifier

    return [
        TurnScoreStacker(
            [
                (
                    "pos",
                    make_attribution_pipeline(
                        TurnPositionTransformer(), GroupedArgmaxLogisticClassifier()
                    ),
                ),
                (
                    "text",
                    make_attribution_pipeline(
                        TurnTextTransformer(), GroupedArgmaxLogisticClassifier()
                    ),
                ),
            ],
            cv=GroupKFold(2),
        )
    ]


def _site_selector():
    from skafa.probes import GroupedArgmaxLogisticClassifier

    return [
        SiteSelector(GroupedArgmaxLogisticClassifier(), cv=3),
        SiteSelector(
            GroupedArgmaxLogisticClassifier(), cv=3, param_grid={"C": [0.1, 1.0]}
        ),
    ]


def _site_ensemble():
    from skafa.probes import GroupedArgmaxLogisticClassifier, GroupedSoftmaxClassifier

    return [
        SiteEnsemble(GroupedArgmaxLogisticClassifier()),
        SiteEnsemble(GroupedSoftmaxClassifier(), sites=["features"]),
    ]


#: class name -> function returning a list of instances
def _shift_detector():
    # the checks' data hold a few tasks: calibrate on two folds
    return [ShiftDetector(n_components=2, cv=2)]


INSTANCE_FACTORIES = {
    "ShiftDetector": _shift_detector,
    "TurnActivationTransformer": _turn_activation_transformer,
    "PerTurn": _per_turn,
    "TurnFeatureUnion": _turn_feature_union,
    "SiteConcatenator": _site_concatenator,
    "AttributionPipeline": _attribution_pipeline,
    "FailureAttributor": _failure_attributor,
    "OnlineAuditor": _online_auditor,
    "PromptedJudge": _prompted_judge,
    "GraftedJudge": _grafted_judge,
    "TurnScoreStacker": _turn_score_stacker,
    "SiteSelector": _site_selector,
    "SiteEnsemble": _site_ensemble,
}
