"""Configs: every shipped config loads and validates; overrides; validation messages."""

import re

import pytest

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.errors import UserError
from meshtrain.run.experiment import abstract_mesh, check_config
from meshtrain.step import optim
from support.configs import configured

NAMES = config_lib.available()
PART_AXIS = {"dp": "data", "pp": "stage", "fsdp": "fsdp", "cp": "context", "ep": "expert", "tp": "tensor",
             "spatial": "tensor"}
# The survey's recipe names (issue 25) name the data set and the optimizer; a recipe whose
# name gives no mesh says its mesh here.
DATA_WORDS = {"wikitext", "imagenet", "digits"}
RECIPE_MESH = {"gpt2_medium_wikitext_lamb": "data:8"}


def test_the_named_configs_exist():
    for name in ["gpt2_tiny_dp8", "gpt2_tiny_fsdp8", "gpt2_tiny_dp8_zero1", "gpt2_tiny_dp2_tp4",
                 "gpt2_tiny_dp2_fsdp2_tp2", "gpt2_small_dp8", "gpt2_medium_dp8_tp4",
                 "gpt2_medium_fsdp8_tp4", "gpt2_large_fsdp32", "gpt2_tiny_pp2_dp4",
                 "gpt2_tiny_dp2_pp2_tp2", "gpt2_tiny_pp4_dp2", "gpt2_tiny_pp4_dp2_circular",
                 "gpt2_medium_dp2_pp4_tp4"]:
        assert name in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_name_matches_mesh_and_validates(name):
    """gpt2_medium_dp8_tp4 must be GPT-2 medium on data=8 x tensor=4, and so on. A size
    that names its family (llama3_8b) is not prefixed with it again: llama3_8b_fsdp8_tp4."""
    cfg = config_lib.load(name)
    m = cfg.model
    prefix = m.size if m.size.startswith(m.name) else f"{m.name}_{m.size}"
    assert name.startswith(prefix + "_"), f"{name}: should start with {prefix}_ (model.name, model.size)"
    parts = name.removeprefix(prefix + "_").split("_")
    expected = dict.fromkeys(mesh_lib.AXES, 1)
    for part in parts:
        if part.startswith("zero"):
            assert cfg.layout == part, f"{name}: layout should be {part}"
            continue
        if part == "circular":
            assert cfg.pipeline.schedule == "circular" and cfg.pipeline.repeats > 1, name
            continue
        if part in optim.NAMES:
            assert cfg.optim.name == part, f"{name}: optim.name should be {part}"
            continue
        if part in DATA_WORDS:
            continue
        if re.fullmatch(r"seq\d+k", part):  # the sequence length, in units of 1024
            assert cfg.model.seq_len == int(part[3:-1]) * 1024, f"{name}: model.seq_len should be {part}"
            continue
        if part == "sp":  # Megatron sequence parallelism over the tensor axis
            assert cfg.layout.endswith("_sp"), f"{name}: layout should be a *_sp preset"
            continue
        kind, n = re.fullmatch(r"([a-z]+)(\d+)", part).groups()
        if kind == "spatial":  # image rows split over tensor
            assert cfg.layout == "dp_spatial", f"{name}: layout should be dp_spatial"
        expected[PART_AXIS[kind]] = int(n)
    if name in RECIPE_MESH:
        expected = mesh_lib.parse_shape(RECIPE_MESH[name])
    shape = mesh_lib.parse_shape(cfg.mesh.shape)
    assert shape == expected, f"{name}: mesh {cfg.mesh.shape} does not match the name"
    check_config(cfg, abstract_mesh(shape))


def test_override_types_and_unknown_keys():
    cfg = config_lib.load("gpt2_tiny_dp8")
    config_lib.override(cfg, "train.steps", "7")
    config_lib.override(cfg, "optim.lr", "1e-3")
    config_lib.override(cfg, "model.scan_layers", "false")
    config_lib.override(cfg, "model.num_layers", "3")
    assert (cfg.train.steps, cfg.optim.lr, cfg.model.scan_layers, cfg.model.num_layers) == (7, 1e-3, False, 3)
    with pytest.raises(UserError, match=r"Unknown config key 'train.stpes'. Did you mean train.steps"):
        config_lib.override(cfg, "train.stpes", "3")
    with pytest.raises(UserError, match=r"--config.train.steps='many': expected an integer"):
        config_lib.override(cfg, "train.steps", "many")


def test_renamed_keys_are_refused_with_their_new_names(tmp_path):
    """train.microbatches (gradient accumulation) is train.grad_accum_steps, apart from the
    pipeline's pipeline.microbatches: refused on the command line and in a config file with
    the new name, translated in a config an older run saved."""
    cfg = config_lib.load("gpt2_tiny_dp8")
    with pytest.raises(UserError, match=r"--config.train.microbatches is now --config.train.grad_accum_steps: "
                                        r".*pipeline.microbatches.* Give --config.train.grad_accum_steps=4\."):
        config_lib.override(cfg, "train.microbatches", "4")
    config_lib.override(cfg, "pipeline.microbatches", "4")  # the pipeline's keeps its name
    old = tmp_path / "old_style.py"
    old.write_text("from meshtrain import config\n\ndef get_config():\n    c = config.base()\n"
                   "    c.train.microbatches = 2\n    return c\n")
    with pytest.raises(UserError, match=r"old_style.py sets train.microbatches, which is now "
                                        r"train.grad_accum_steps: .* Rename it in the file."):
        config_lib.load(str(old))
    saved = config_lib.base().to_dict()
    saved["train"]["microbatches"] = saved["train"].pop("grad_accum_steps") + 3
    upgraded = config_lib.upgrade(saved)
    assert upgraded["train"]["grad_accum_steps"] == 4 and "microbatches" not in upgraded["train"]
    assert "microbatches" in saved["train"]  # the run's own dict is left as it was


def test_unknown_config_name_lists_names():
    with pytest.raises(UserError, match=r"Unknown config 'gpt2_tiny_dp9'. Did you mean .*gpt2_tiny_dp8"):
        config_lib.load("gpt2_tiny_dp9")


def test_override_forms():
    from meshtrain import cli
    rest, overrides = cli.split_overrides(
        ["--config=gpt2_tiny_dp8", "--config.train.steps", "5", "--noconfig.model.scan_layers",
         "--workdir=w", "--config.model.scan_layers", "--config.train.seed=3"])
    assert rest == ["--config=gpt2_tiny_dp8", "--workdir=w"]
    assert overrides == [("train.steps", "5"), ("model.scan_layers", "false"),
                         ("model.scan_layers", "true"), ("train.seed", "3")]


def check(name, mesh, message, **overrides):
    cfg = configured(name, **overrides)
    with pytest.raises(UserError) as e:
        check_config(cfg, abstract_mesh(mesh_lib.parse_shape(mesh)))
    assert re.search(message, str(e.value)), str(e.value)


def test_heads_not_divisible_by_tensor():
    check("gpt2_tiny_dp2_tp4", "tensor:8",
          r"model.num_heads = 4 is not divisible by 8: layout 'dp_tp' splits 'heads' over mesh axes tensor=8")


def test_mlp_not_divisible_by_tensor():
    check("gpt2_tiny_dp2_tp4", "data:2,tensor:4", r"model.mlp_dim = 250 is not divisible by 4",
          **{"model.mlp_dim": 250})


def test_batch_not_divisible():
    check("gpt2_tiny_dp8", "data:8", r"train.batch_size=20 must be divisible by train.grad_accum_steps x "
          r"batch shards = 2 x 8 = 16", **{"train.batch_size": 20, "train.grad_accum_steps": 2})


def test_embed_not_divisible_by_heads():
    check("gpt2_tiny_dp8", "data:8", r"model.embed_dim=64 is not divisible by model.num_heads=5",
          **{"model.num_heads": 5})


@pytest.mark.parametrize("key, value, message", [
    ("model.remat", "some", r"model.remat='some' is not a remat policy. Choose one of: none, full, save_dots"),
    ("model.dtype", "fp8", r"model.dtype='fp8': choose one of float32, bfloat16, float16"),
    ("model.size", "huge", r"model.size='huge' is not a gpt2 size; choose one of tiny, small"),
    ("optim.schedule", "step", r"optim.schedule='step': choose one of cosine, constant"),
    ("layout", "batch:data;foo:tensor", r"Unknown logical axis name 'foo'"),
    ("layout", "dpp", r"Unknown layout 'dpp'. The presets are"),
    ("data.kind", "csv", r"Unknown data.kind 'csv'"),
])
def test_validation_messages(key, value, message):
    cfg = config_lib.load("gpt2_tiny_dp8")
    config_lib.override(cfg, key, value)
    with pytest.raises(UserError, match=message):
        check_config(cfg, abstract_mesh(mesh_lib.parse_shape(cfg.mesh.shape)))


def test_vocab_smaller_than_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 2000)
    check("gpt2_tiny_dp8", "data:8", r"model.vocab_size=100 is smaller than the data's vocabulary \(257",
          **{"data.kind": "text", "data.path": str(tmp_path / "a.txt"), "model.vocab_size": 100})


@pytest.mark.parametrize("name, mesh, message, overrides", [
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"model.num_layers=3 is not divisible by stages x repeats "
     r"= 2 x 1 = 2", {"model.num_layers": 3}),
    ("gpt2_tiny_pp4_dp2_circular", "data:2,stage:4", r"model.num_layers=12 is not divisible by stages "
     r"x repeats = 4 x 2 = 8", {"model.num_layers": 12}),
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"train.batch_size=32 must be divisible by "
     r"train.grad_accum_steps x pipeline.microbatches x batch shards in a stage = 1 x 16 x 4 = 64",
     {"pipeline.microbatches": 16}),
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"The mesh has stage=2 but pipeline.microbatches=0",
     {"pipeline.microbatches": 0}),
    ("gpt2_tiny_pp4_dp2_circular", "data:2,stage:4", r"pipeline.microbatches=6 is not a multiple of "
     r"stage=4: the circular schedule .* Use M = 8", {"pipeline.microbatches": 6}),
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"pipeline.repeats=2 needs pipeline.schedule=circular",
     {"pipeline.repeats": 2}),
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"schedule=circular with pipeline.repeats=1 is gpipe",
     {"pipeline.schedule": "circular"}),
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"pipeline.schedule='pipedream': choose one of gpipe, circular, "
     r"1f1b, interleaved", {"pipeline.schedule": "pipedream"}),
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"schedule=interleaved with pipeline.repeats=1 is 1f1b",
     {"pipeline.schedule": "interleaved"}),
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"pipeline.repeats=2 needs pipeline.schedule=interleaved",
     {"pipeline.schedule": "1f1b", "pipeline.repeats": "2", "model.num_layers": "4"}),
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"pipeline.stash='all': choose one of inputs, residuals",
     {"pipeline.schedule": "1f1b", "pipeline.stash": "all"}),
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"pipeline.split='vjp': choose one of jaxpr, two_vjps \(how zb splits",
     {"pipeline.schedule": "zb", "pipeline.split": "vjp"}),
    ("gpt2_tiny_pp2_dp4", "data:4,stage:2", r"Layout 'dp' does not put the logical axis 'stage' on the "
     r"mesh axis 'stage' in its params rules.*Use a pipeline layout \(dp_pp, fsdp_pp", {"layout": "dp"}),
])
def test_pipeline_validation(name, mesh, message, overrides):
    check(name, mesh, message, **overrides)


def test_few_microbatches_warn():
    from meshtrain.parallel.pipeline import scan as pipeline
    cfg = config_lib.load("gpt2_tiny_pp4_dp2")
    config_lib.override(cfg, "pipeline.microbatches", "2")
    model = check_config(cfg, abstract_mesh(mesh_lib.parse_shape(cfg.mesh.shape))).model
    (warning,) = pipeline.warnings_for(model.pipeline)
    assert re.search(r"pipeline.microbatches=2 < stage=4: the bubble \(S-1\)/\(r\*M\+S-1\) = 60% "
                     r"of the pipelined work dominates; use M >= 16", warning), warning
    config_lib.override(cfg, "pipeline.microbatches", "4")
    model = check_config(cfg, abstract_mesh(mesh_lib.parse_shape(cfg.mesh.shape))).model
    assert pipeline.warnings_for(model.pipeline) == []
