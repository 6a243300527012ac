import pytest

from fastweights import FeatureMap, Memory, Objective, Optimizer, Recipe, RecipeError, Retention


def test_default_recipe_is_deltanet_like_and_describes_four_axes():
    row = Recipe().describe()
    assert set(row) == {"name", "memory", "feature_map", "objective", "optimizer", "retention"}
    assert row["objective"] == "½‖M(k) − v‖²"


@pytest.mark.parametrize("build, words", [
    (lambda: Memory(kind="tree"), ["memory.kind", "tree"]),
    (lambda: Memory(kind="mlp", normalize=True), ["normalize", "linear"]),
    (lambda: Objective(kind="l2", window=3), ["window", "omega"]),
    (lambda: Objective(kind="dot", probe=True), ["probe", "l2"]),
    (lambda: Optimizer(minibatch=0), ["minibatch", "positive"]),
    (lambda: Retention(kind="constant"), ["constant", "schedule"]),
    (lambda: Retention(kind="constant", gamma=1.5), ["gamma", "(0, 1]"]),
    (lambda: Retention(kind="scalar", gamma=0.9), ["gamma", "constant"]),
    (lambda: FeatureMap(kind="polynomial", degree=5), ["degree"]),
    (lambda: Recipe(memory=Memory(kind="kv"), feature_map=FeatureMap(kind="identity")), ["kv", "exp"]),
    (lambda: Recipe(feature_map=FeatureMap(kind="exp")), ["exp", "kv"]),
    (lambda: Recipe(memory=Memory(kind="mlp"), retention=Retention(kind="diagonal")), ["diagonal", "MLP"]),
    (lambda: Recipe(objective=Objective(kind="least_squares")), ["least_squares", "closed_form"]),
    (lambda: Recipe(optimizer=Optimizer(kind="closed_form")), ["closed_form", "least_squares"]),
    (lambda: Recipe(objective=Objective(kind="dot"), optimizer=Optimizer(householder_steps=2)),
     ["householder_steps", "l2"]),
    (lambda: Recipe(optimizer=Optimizer(minibatch=4), retention=Retention(kind="scalar")), ["decay_first"]),
    (lambda: Recipe(memory=Memory(kind="kv"), feature_map=FeatureMap(kind="exp"),
                    optimizer=Optimizer(kind="momentum")), ["kv", "gd"]),
    (lambda: Recipe(retention=Retention(kind="householder")), ["householder", "kv"]),
    (lambda: Recipe(memory="linear"), ["recipe.memory", "Memory"]),
])
def test_impossible_combinations_are_rejected_with_a_message(build, words):
    with pytest.raises(RecipeError) as e:
        build()
    for w in words:
        assert w in str(e.value)


def test_new_recipes_no_paper_has_are_valid():
    # diagonal-decay delta rule with momentum and Muon on a polynomial feature map
    r = Recipe(name="novel", feature_map=FeatureMap(kind="polynomial", degree=2),
               objective=Objective(kind="omega", window=3), optimizer=Optimizer(kind="muon"),
               retention=Retention(kind="diagonal", decay_first=False))
    assert "Muon" in r.describe()["optimizer"]


def test_constant_retention_schedules():
    import math

    assert Retention(kind="constant", schedule="retnet").log_gammas(2) == [math.log(1 - 2 ** -5), math.log(1 - 2 ** -6)]
    alibi = Retention(kind="constant", schedule="alibi").log_gammas(8)
    assert alibi[0] == -(2 ** -1) and alibi[-1] == -(2 ** -8)


def test_alibi_slopes_follow_the_authors_code():
    """Powers of two: 2^(−8(h+1)/H). Otherwise the P = 2^⌊log2 H⌋ slopes, then every other slope of
    the 2P-head sequence (the authors' interleaving; the paper's formula gives other numbers at H = 6, 12)."""
    from fastweights.recipe import alibi_slopes

    expected_exponents = {  # m_h = 2^(−e_h)
        2: [4, 8],
        4: [2, 4, 6, 8],
        6: [2, 4, 6, 8, 1, 3],
        8: [1, 2, 3, 4, 5, 6, 7, 8],
        12: [1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5],
        16: [0.5 * (h + 1) for h in range(16)],
    }
    for H, exps in expected_exponents.items():
        assert alibi_slopes(H) == [2.0 ** -e for e in exps], H
        assert Retention(kind="constant", schedule="alibi").log_gammas(H) == [-(2.0 ** -e) for e in exps]
    assert [round(m, 4) for m in alibi_slopes(6)] == [0.25, 0.0625, 0.0156, 0.0039, 0.5, 0.125]


def test_inner_bias_and_minibatch_average_validation():
    from fastweights import Memory, Optimizer, Recipe, RecipeError

    assert not Memory(kind="linear", bias=True).is_plain_linear
    assert Recipe(memory=Memory(kind="linear", bias=True)).uses_autodiff
    for bad in (lambda: Memory(kind="kv", bias=True),
                lambda: Optimizer(kind="momentum", minibatch=4, minibatch_average=True),
                lambda: Optimizer(kind="gd", minibatch=1, minibatch_average=True),
                lambda: Recipe(memory=Memory(kind="mlp", bias=True), optimizer=Optimizer(kind="muon")),
                lambda: Recipe(optimizer=Optimizer(kind="gd", minibatch=4, minibatch_average=True),
                               retention=Retention(kind="scalar", decay_first=False))):
        with pytest.raises(RecipeError):
            bad()


def test_unit_sq_norm_is_the_feature_norm_of_a_unit_key():
    import torch

    from fastweights.features import apply_feature_map
    from tests.tolerances import EXACT_F64

    x = torch.randn(5, 6, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True)
    for fm in (FeatureMap(), FeatureMap(kind="polynomial", degree=2), FeatureMap(kind="polynomial", degree=3),
               FeatureMap(kind="polynomial", degree=2, homogeneous=True), FeatureMap(kind="taylor", degree=2),
               FeatureMap(kind="taylor", degree=3, homogeneous=True)):
        sq = (apply_feature_map(fm, x) ** 2).sum(-1)
        assert (sq - fm.unit_sq_norm()).abs().max().item() < EXACT_F64, fm
    assert ((apply_feature_map(FeatureMap(kind="relu"), x) ** 2).sum(-1) <= 1 + EXACT_F64).all()
    with pytest.raises(RecipeError):
        FeatureMap(kind="elu1").unit_sq_norm()


def test_step_normalizer_counts_what_one_step_sums():
    from fastweights import zoo

    assert zoo.get("deltanet").step_normalizer() == 1
    assert zoo.get("omeganet").step_normalizer() == 16 * 4 * 3  # b · c · ‖φ(k)‖² (1 + 1 + 1 for unit k)
    assert zoo.get("ttt_linear").step_normalizer() == 1  # the averaged mini-batch counts once


@pytest.mark.parametrize("field, value, message", [
    ("name", 3, "recipe.name must be a non-empty string, got 3"),
    ("name", "", "recipe.name must be a non-empty string, got ''"),
    ("citation", 5, "recipe.citation must be a string, got 5"),
    ("scale", -1.0, r"recipe.scale must be a finite number > 0 or None \(K\^-0.5\), got -1.0"),
    ("scale", "x", r"recipe.scale must be a finite number > 0 or None \(K\^-0.5\), got 'x'"),
])
def test_name_citation_and_scale_are_checked(field, value, message):
    """Recipe(name=3), Recipe(scale=-1.0) and Recipe(scale='x') were accepted (a negative default scale flips every
    query; 'x' failed deep inside a call)."""
    with pytest.raises(RecipeError, match="^" + message + "$"):
        Recipe(**{field: value})
