"""Every test process gets 8 fake CPU devices, set before JAX starts its backend, and
W&B in its offline mode."""

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

# train.trackers=wandb runs in W&B's offline mode in every test and every process a test
# starts (they inherit this environment): no test reaches the network.
os.environ["WANDB_MODE"] = "offline"


import pytest  # noqa: E402

from meshtrain import config as config_lib  # noqa: E402


def configured(name: str, **overrides):
    """configured("gpt2_tiny_dp8", **{"train.steps": 3}) -> locked ConfigDict, each override
    applied as --config.KEY=VALUE would be. Module-scoped fixtures import it
    (`from conftest import configured`); tests take the `make_config` fixture."""
    cfg = config_lib.load(name)
    for k, v in overrides.items():
        config_lib.override(cfg, k, str(v))
    return cfg


@pytest.fixture
def make_config():
    """make_config("gpt2_tiny_dp8", **{"train.steps": "3"}) -> locked ConfigDict."""
    return configured
