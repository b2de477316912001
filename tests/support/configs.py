"""A named config with overrides, as the command line would make it."""

from meshtrain import config as config_lib


def configured(name: str, **overrides):
    """configured("gpt2_tiny_dp8", **{"train.steps": 3}) -> locked ConfigDict, each override
    applied as --config.KEY=VALUE would be (values are written as text first). Tests take
    it as the `make_config` fixture, module-scoped fixtures and helpers import it."""
    return config_lib.load(name, overrides.items())
