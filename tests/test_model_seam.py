"""The model seam: a model written from docs/models.md, defined here outside meshtrain/,
registers itself and trains under data, FSDP, tensor and pipeline layouts exactly like on
one device, with the chunked loss (its hidden/project split) and the planner's formulas
(its layer_activation_bytes)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from meshtrain import config as config_lib
from meshtrain.models import family, stack
from meshtrain.models.hook import UNSHARDED
from support.training import assert_same_training, losses_and_grads, trained


# --- a toy language model: embedding, a stack of residual MLP layers, untied head ---

@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig(family.ModelConfig):
    embed_dim: int
    mlp_dim: int


class ToyLayer(nnx.Module):
    def __init__(self, cfg: ToyConfig, rngs: nnx.Rngs, stack_size: int):
        self.w_in = stack.param(rngs, (cfg.embed_dim, cfg.mlp_dim), ("embed", "mlp"), stack_size, jnp.float32, "normal")
        self.w_out = stack.param(rngs, (cfg.mlp_dim, cfg.embed_dim), ("mlp", "embed"), stack_size, jnp.float32, "normal")

    def __call__(self, x_btd, constrain, key):
        h_btf = constrain(jax.nn.relu(x_btd @ self.w_in[...]), ("batch", "length", "mlp"))
        return constrain(x_btd + h_btf @ self.w_out[...], ("batch", "length", "embed"))


class Toy(nnx.Module):
    def __init__(self, cfg: ToyConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        v, d = cfg.padded_vocab_size, cfg.embed_dim
        self.embed = stack.param(rngs, (v, d), ("vocab", "embed"), None, jnp.float32, "normal", 1.0)
        self.layers = ToyLayer(cfg, rngs, cfg.num_layers)
        self.head = stack.param(rngs, (d, v), ("embed", "vocab"), None, jnp.float32, "normal")

    def hidden(self, tokens_bt, constrain=UNSHARDED, key=None, run_layers=None):
        """-> (h [B, T, D], the head [D, V]): everything before the output projection."""
        x = constrain(jnp.take(self.embed[...], tokens_bt, axis=0), ("batch", "length", "embed"))
        x = stack.run_layers(self.layers, x, constrain, key, run_layers, num_layers=self.cfg.num_layers,
                             remat_policy=self.cfg.remat, scan=self.cfg.scan_layers)
        return x, self.head[...]

    @staticmethod
    def project(h_btd, w_dv, constrain=UNSHARDED):
        """h [B, t, D] -> logits [B, t, V], from its arguments alone (the loss calls it per chunk)."""
        return constrain(h_btd @ w_dv, ("batch", "length", "vocab"))

    def __call__(self, tokens_bt, constrain=UNSHARDED, key=None, run_layers=None):
        return self.project(*self.hidden(tokens_bt, constrain, key, run_layers), constrain)


def toy_activations(cfg: ToyConfig, b: int):
    t, d, f, v = cfg.seq_len, cfg.embed_dim, cfg.mlp_dim, cfg.padded_vocab_size
    return [("residual", (b, t, d), ("batch", "length", "embed")),
            ("hidden", (b, t, f), ("batch", "length", "mlp")),
            ("logits", (b, t, v), ("batch", "length", "vocab"))]


def toy_params(cfg: ToyConfig) -> int:
    return 2 * cfg.vocab_size * cfg.embed_dim + 2 * cfg.num_layers * cfg.embed_dim * cfg.mlp_dim


family.register(family.Family(
    name="toy", config=ToyConfig, module=Toy, stacked="layers",
    sizes={"tiny": dict(num_layers=4, embed_dim=32, mlp_dim=64, vocab_size=256, seq_len=32)},
    activations=toy_activations, num_params=toy_params,
    flops_per_token=lambda c: 6.0 * toy_params(c),
    # Kept for backward: the layer input (D) and the hidden after ReLU (F, split over tensor).
    layer_activation_bytes=lambda c, tokens, t, remat: family.korthikanti_bytes(
        tokens, 4, whole=c.embed_dim, split=0 if remat == "full" else c.mlp_dim, scores=0, tensor=t),
    size_keys={"embed": "model.embed_dim", "mlp": "model.mlp_dim"},
    describe=lambda c: f"toy: {c.num_layers} layers, embed {c.embed_dim}, mlp {c.mlp_dim}",
))

# --- the test ----------------------------------------------------------------------

LAYOUTS = {"dp8": ("data:8", "dp", 0), "fsdp8": ("fsdp:8", "fsdp", 0),
           "dp2_tp4": ("data:2,tensor:4", "dp_tp", 0), "pp2_dp4": ("data:4,stage:2", "dp_pp", 4)}


def toy_config(mesh: str, layout: str, pipeline_microbatches: int):
    c = config_lib.base(size="tiny", mesh=mesh, layout=layout)
    c.model.name = "toy"
    c.model.vocab_multiple = 8
    c.pipeline.microbatches = pipeline_microbatches
    c.train.update(batch_size=16, eval_every=0, loss_chunk=8)  # 4 chunks of the 32 positions
    c.optim.update(lr=1e-2, warmup_steps=0)  # support.training.FULL_LR
    return c


@pytest.fixture(scope="module")
def one_device():
    return losses_and_grads(toy_config("data:1", "dp", 0), devices=jax.devices()[:1], mesh_shape="data:1")


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_model_outside_meshtrain_trains_under_every_layout(name, one_device):
    """Against one device's plain jax.grad; the layout's gradients read off its train step."""
    assert_same_training(name, trained(toy_config(*LAYOUTS[name])), one_device)


def test_the_toy_model_reports_through_the_seam():
    from meshtrain.run.experiment import Experiment
    from meshtrain.runlog import metrics
    exp = Experiment.build(toy_config("data:1", "dp", 0), devices=jax.devices()[:1], mesh_shape="data:1")
    cfg = exp.model.cfg
    assert exp.model.stacked == "layers"
    assert exp.num_params() == 2 * 256 * 32 + 2 * 4 * 32 * 64 == exp.num_stored_params()
    assert metrics.flops_per_token(cfg) == 6.0 * exp.num_params()


def test_the_chunked_loss_takes_the_seam_and_equals_whole_logits():
    from meshtrain.run.experiment import Experiment
    from meshtrain.step import loss
    assert loss.has_seam(Toy)
    chunked = Experiment.build(toy_config("data:2,tensor:4", "dp_tp", 0))
    assert loss.num_chunks(chunked.model.cfg.seq_len, chunked.cfg.train.loss_chunk) == 4
    whole = toy_config("data:2,tensor:4", "dp_tp", 0)
    config_lib.override(whole, "train.loss_chunk", "0")
    # The chunked run is test_a_model_outside_meshtrain_trains_under_every_layout[dp2_tp4]'s
    # train step (compiled once per run).
    assert_same_training("whole logits", losses_and_grads(whole), trained(toy_config("data:2,tensor:4", "dp_tp", 0)))


def test_the_planner_reads_the_toy_through_the_seam():
    """Activation memory from the family's layer_activation_bytes, logits of one chunk."""
    from meshtrain.planner import analytic, hardware, report
    from meshtrain.run.experiment import Experiment
    exp = Experiment.build(toy_config("data:2,tensor:4", "dp_tp", 0))
    cfg, rows = exp.model.cfg, 16 // 2
    layers = cfg.num_layers * family.korthikanti_bytes(rows * cfg.seq_len, 4, whole=cfg.embed_dim,
                                                       split=cfg.mlp_dim, scores=0, tensor=4)
    logits = rows * (cfg.seq_len // 4) * (cfg.padded_vocab_size / 4) * 2 * 4  # logits and gradient, float32
    projection = cfg.padded_vocab_size / 4 * cfg.embed_dim * 4
    assert analytic.activations(exp) == pytest.approx(layers + logits + projection)
    r = report.plan(exp, hardware.get("h100"))
    assert r["predicted_step_time_s"] > 0
    assert r["analytic_memory_per_device_bytes"]["activations"] == analytic.activations(exp)
