"""Per-framework standardisation, CORAL and the labelling order."""

import numpy as np
import pytest

from skafa.domain import coral, label_priority, standardize_per_framework
from skafa.testing import make_site_features


def _runs(seed=0):
    return make_site_features(n=40, n_sites=2, n_features=5, signal_site=0, seed=seed)[0]


def test_standardize_uses_the_reference_statistics():
    X = _runs()
    scaled = X.with_values(X.values * 4.0 + 2.0)
    Z = standardize_per_framework(scaled)
    np.testing.assert_allclose(Z.values.mean(axis=0), 0, atol=1e-10)
    np.testing.assert_allclose(Z.values.std(axis=0), 1, atol=1e-10)
    # with the unscaled runs as reference, the scale stays visible
    W = standardize_per_framework(scaled, reference=X)
    assert W.values.std(axis=0).mean() == pytest.approx(4.0, rel=0.05)
    assert Z.sites == X.sites and (Z.offsets == X.offsets).all()
    with pytest.raises(ValueError, match="reference has 1 site"):
        standardize_per_framework(X, reference=X.select_sites(["s0"]))


def test_coral_matches_second_moments_of_the_target():
    S, T = _runs(0), _runs(1)
    rng = np.random.default_rng(0)
    mix = rng.normal(size=(5, 5))
    T = T.with_values(np.einsum("tsf,fg->tsg", T.values, mix))
    S2, T2 = coral(S, T, regularization=1e-6)
    for j in range(2):
        np.testing.assert_allclose(np.cov(S2.values[:, j], rowvar=False),
                                   np.cov(T2.values[:, j], rowvar=False), atol=0.05)
    with pytest.raises(ValueError, match="regularization"):
        coral(S, T, regularization=0)


def test_label_priority_margins():
    m = label_priority([0.5, 0.4, 0.1, 0.9, 0.1, 1.0], [0, 3, 5, 6])
    np.testing.assert_allclose(m, [0.1, 0.8, 1.0])
    with pytest.raises(ValueError, match="offsets"):
        label_priority([0.5, 0.5], [0, 3])


def test_coral_adapter_matches_the_function_and_routes_two_frameworks():
    from skafa.domain import CoralAdapter

    S, T = _runs(0), _runs(1)
    T = T.with_values(T.values * 3.0 + 2.0)
    ad = CoralAdapter()
    fitted_source = ad.fit_transform(S, target_X=T)
    ref_source, ref_target = coral(S, T)
    np.testing.assert_allclose(fitted_source.values, ref_source.values, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ad.transform(T).values, ref_target.values, rtol=1e-4,
                               atol=1e-4)
    assert ad.n_target_runs_ == T.n_conversations
    # without a target, the map is the identity on standardised features
    own = CoralAdapter(regularization=1e-9).fit_transform(S)
    np.testing.assert_allclose(own.values, standardize_per_framework(S).values, atol=1e-3)
    with pytest.raises(ValueError, match="target_X has sites"):
        CoralAdapter().fit(S, target_X=T.select_sites(["s0"]))
    sub = ad.transform(T.select_sites(["s1"]))
    np.testing.assert_allclose(sub.values[:, 0], ad.transform(T).values[:, 1])
    with pytest.raises(ValueError, match="adapter was fitted on"):
        ad.transform(S.with_values(S.values[..., :3]))
