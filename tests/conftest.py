"""Every test process gets 8 fake CPU devices, set before JAX starts its backend."""

import jax

jax.config.update("jax_num_cpu_devices", 8)


import pytest  # noqa: E402

from meshtrain import config as config_lib  # noqa: E402


@pytest.fixture
def make_config():
    """make_config("gpt2_tiny_dp8", **{"train.steps": "3"}) -> locked ConfigDict."""
    def make(name: str, **overrides):
        cfg = config_lib.load(name)
        for k, v in overrides.items():
            config_lib.override(cfg, k, str(v))
        return cfg
    return make
