"""Expert parallelism in the planner (planner/experts.py) and the linter's MoE checks
(planner/lint_experts.py): the compiled step's all-to-alls over `expert` against their
formula in both dispatch modes, the experts' weights per device, the activation formula
beside the dense family's, the search's expert axes, and the findings. Mixtral tiny, each
config compiled once."""

import pytest

from support.configs import configured
from meshtrain import models
from meshtrain.pictures import text
from meshtrain.planner import analytic, experts, hardware, lint, report as report_lib, search
from meshtrain.run.experiment import Experiment

H100 = hardware.get("h100")
RUNS = {  # name: (config, overrides)
    "ep4_dropless": ("mixtral_tiny_dp2_ep4", {"moe.dispatch": "dropless"}),
    "ep4_capacity": ("mixtral_tiny_dp2_ep4", {"moe.dispatch": "capacity"}),
    "ep4_dropless_full": ("mixtral_tiny_dp2_ep4", {"moe.dispatch": "dropless", "model.remat": "full"}),
    "ep2_tp2_dropless": ("mixtral_tiny_dp2_ep2_tp2", {}),
    "ep2_tp2_capacity": ("mixtral_tiny_dp2_ep2_tp2", {"moe.dispatch": "capacity"}),
    "fsdp2_ep4_dropless": ("mixtral_tiny_fsdp2_ep4", {}),
    "fsdp2_ep4_capacity": ("mixtral_tiny_fsdp2_ep4", {"moe.dispatch": "capacity"}),
    "dense_twin": ("llama_tiny_dp8", {"model.mlp_dim": 256}),  # equal active parameters
}


@pytest.fixture(scope="module")
def planned():
    out = {}
    for name, (config, overrides) in RUNS.items():
        exp = Experiment.build(configured(config, **overrides))
        compiled = exp.compile(analysis=True)  # as `meshtrain plan` compiles: same HLO and buffers, faster
        out[name] = (exp, compiled, report_lib.plan(exp, H100, compiled, 0.0))
    return out


@pytest.mark.parametrize("name", [n for n in RUNS if n != "dense_twin"])
def test_compiled_all_to_alls_equal_the_formula(name, planned):
    """Every all-to-all byte and op over `expert` is the formula's (acceptance: within
    1.2x; it is 1.00 exactly): per layer, dropless 2 [e, n k, D] float buffers and the
    int32 ids forward, 2 back; capacity 2 [X, b, C, D] each way; (e-1)/e of each on the wire."""
    exp, _, r = planned[name]
    x = r["experts"]
    cfg = exp.model.cfg
    e = exp.mesh.shape["expert"]
    assert x["mesh_axes"] == ["expert"] and x["split"] == e and x["dispatch"] == cfg.moe.dispatch
    print(f"{name}: compiled {x['compiled_bytes']:,.0f} B in {x['compiled_count']} ops, formula "
          f"{x['bytes']:,.0f} B in {x['count']}, ratio {x['ratio']:.4f}")
    assert x["compiled_count"] == x["count"]
    assert x["compiled_bytes"] == pytest.approx(x["bytes"], rel=1e-9)
    rows = 32 // exp.layout.shards("batch", exp.mesh.shape)[0]
    passes = 3 if cfg.remat == "full" else 2
    if cfg.moe.dispatch == "dropless":
        n_k = rows * 128 * 2
        per_layer = passes * 2 * e * n_k * 64 * 4 + (passes - 1) * e * n_k * 4
    else:
        per_layer = passes * 2 * 4 * rows * 80 * 64 * 4  # C = ceil(2 x 128 x 1.25 / 4) = 80
    assert x["bytes"] == pytest.approx(2 * (e - 1) / e * per_layer, rel=1e-12)


def test_the_rerun_is_named_and_the_bound_met(planned):
    """The bound over expert counts forward and backward; remat=full's rerun of the MoE
    forward (3 more all-to-alls a layer) is named as known excess; the expert weights are
    not gathered (their tokens travel), so the bound holds no FSDP gather over expert."""
    for name in ("ep4_dropless", "ep4_dropless_full"):
        r = planned[name][2]
        [row] = [a for a in r["collectives_by_axes"] if a["mesh_axes"] == ["expert"]]
        assert row["bytes"] >= row["lower_bound_bytes"] and row["ratio"] < 1.01 * (
            1 + r["experts"]["terms"]["recompute"] / r["experts"]["bound_bytes"])
    full = planned["ep4_dropless_full"][2]
    assert full["experts"]["ops"]["recompute"] == 2 * 3
    [row] = [a for a in full["collectives_by_axes"] if a["mesh_axes"] == ["expert"]]
    assert any("reruns the MoE layer" in why for why in row["excess"])


@pytest.mark.parametrize("name", ["ep4_dropless", "ep2_tp2_capacity", "fsdp2_ep4_dropless"])
def test_expert_weights_per_device(name, planned):
    """L x 3 X D F / (experts x embed x mlp splits) x 4 B: the compiled step's argument
    shards equal it; Adam's two moments twice it; the plan reports both with the rest."""
    exp, _, r = planned[name]
    w = r["experts"]["weights"]
    cfg = exp.model.cfg
    whole = cfg.num_layers * 3 * cfg.num_experts * cfg.embed_dim * cfg.mlp_dim * 4
    split = {"ep4_dropless": 4, "ep2_tp2_capacity": 2 * 2, "fsdp2_ep4_dropless": 4 * 2}[name]
    assert w["params"] == whole / split == w["compiled_params"]
    assert w["optimizer"] == 2 * w["params"]
    assert w["params"] + w["rest_params"] == pytest.approx(r["memory_per_device_bytes"]["params"], rel=1e-12)
    assert "expert all-to-all over expert" in text.render({**r, "config_name": name})


def test_activation_formula_against_the_compiled_step(planned):
    """The float32 formula (the CPU compile's width) against the compiled activations: the
    mixtral ratios sit where the dense twin's does (the CPU backend's buffers beyond what
    the formula keeps: XLA's attention, and here ragged_dot's lowering), and capacity's
    buffers cost less than dropless's e-fold ones."""
    ratios = {}
    for name in ("ep4_dropless", "ep4_capacity", "fsdp2_ep4_dropless", "ep2_tp2_capacity", "dense_twin"):
        r = planned[name][2]
        ratios[name] = r["memory_per_device_bytes"]["activations"] / r["fits"]["cpu_account"]["float32"]
    print({k: round(v, 3) for k, v in ratios.items()})
    dense = ratios.pop("dense_twin")
    assert all(0.75 * dense <= v <= 1.25 * dense for v in ratios.values()), (ratios, dense)
    drop, cap = (analytic.activations(planned[n][0]) for n in ("ep4_dropless", "ep4_capacity"))
    assert cap < drop


def test_search_considers_expert_axes_only_for_experts():
    """At 8 devices the candidates of Mixtral tiny (4 experts) split experts over expert:2
    and expert:4, never 8 (does not divide 4); Llama tiny's never use expert."""
    mix = models.size_dims(configured("mixtral_tiny_dp8").model)
    dense = models.size_dims(configured("llama_tiny_dp8").model)
    cands, dropped = search.enumerate_candidates(8, 2, None, remats=("none",), num_experts=mix["num_experts"])
    sizes = {dict(c.mesh)["expert"] for c in cands}
    assert sizes == {1, 2, 4} and {c.layout for c in cands if dict(c.mesh)["expert"] > 1} >= {"dp_ep", "fsdp_ep"}
    assert dropped["expert axis does not divide model.num_experts"] > 0
    plain, _ = search.enumerate_candidates(8, 2, None, remats=("none",), num_experts=dense.get("num_experts"))
    assert {dict(c.mesh)["expert"] for c in plain} == {1}


def only(findings, code):
    [f] = [f for f in findings if f.code == code]
    return f


def test_experts_indivisible():
    """4 experts over expert:8: an error whose fix moves the surplus to data."""
    cfg = configured("mixtral_tiny_dp2_ep4", **{"mesh.shape": "expert:8"})
    f = only(lint.lint(cfg), "experts-indivisible")
    assert f.severity == "error" and "model.num_experts=4" in f.what and "expert=8 = 8 devices" in f.what
    assert lint.fix_overrides(f.fix) == [("mesh.shape", "data:2,expert:4")]
    assert not [f for f in lint.lint(configured("mixtral_tiny_dp2_ep4")) if f.code == "experts-indivisible"]


def test_capacity_drops_estimate_and_fix():
    """Uniform routing at capacity factor 1.0 (T 128, X 4, k 2: C = 64, N ~ Binomial(128,
    1/2)): 3.5% expected dropped, by the exact sum and by a numpy Monte Carlo of the same
    routing; 1.1 (C = 71) is the first factor under 1%, and the fix aims under 1% / 4 (the
    router at initialisation is not quite uniform): 1.15; 1.25 is not flagged."""
    import numpy as np
    share = experts.drop_share(128, 4, 2, 1.0)
    rng = np.random.default_rng(0)
    picks = np.argsort(rng.random((4000, 128, 4)), axis=-1)[..., :2]  # k distinct experts a token
    counts = np.stack([(picks == x).any(-1).sum(-1) for x in range(4)], -1)  # [sequences, X]
    sampled = np.maximum(counts - 64, 0).sum() / (4000 * 128 * 2)
    print(f"expected drop share {share:.4f}, Monte Carlo {sampled:.4f}")
    assert share == pytest.approx(sampled, rel=0.03)
    cfg = configured("mixtral_tiny_dp8", **{"moe.dispatch": "capacity", "moe.capacity_factor": 1.0})
    f = only(lint.lint(cfg), "capacity-drops")
    assert f.severity == "warning" and "3.5% of the routed copies" in f.what and "64 slots" in f.what
    assert lint.fix_overrides(f.fix) == [("moe.capacity_factor", "1.15")]  # estimate under 1% / 4
    assert "--config.moe.dispatch=dropless" in f.fix
    assert experts.drop_share(128, 4, 2, 1.1) < 0.01 <= experts.drop_share(128, 4, 2, 1.05)
    plain = configured("mixtral_tiny_dp8", **{"moe.dispatch": "capacity"})
    assert not [f for f in lint.lint(plain) if f.code == "capacity-drops"]


def test_expert_on_dcn_costs_the_formula_bytes():
    """Across nodes, the cost quotes the all-to-all bytes per step of planner/experts.py."""
    cfg = configured("mixtral_tiny_dp2_ep4", **{"mesh.dcn": "expert:2"})
    f = only(lint.lint(cfg), "expert-on-dcn")
    assert "about 6.0 MiB per device per step" in f.cost  # 6,316,032 B, as compiled
    assert lint.fix_overrides(f.fix) == [("mesh.dcn", "data:2")]
