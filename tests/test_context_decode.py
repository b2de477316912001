"""Decoding with the KV cache under context parallelism: greedy generation on a layout that
splits `length` over `context` equals recomputing the whole prefix on one device, and
the cache stays split by position (no device gathers it while decoding).

Decoding never reorders: a cache is written at positions pos..pos+t-1, so the prefill and
every step run in natural order (stack.positions), and the cache [L, B, S, K, E] is split
into contiguous pieces of S over `context` (docs/layouts.md, "Long sequences"). The prompt
(5) is a length the context axis does not divide (GSPMD pads it); the cache's (17) is
rounded up to a multiple of the pieces (sampling/generate.cache_length).
"""

import jax
import numpy as np
import pytest

from meshtrain import config as config_lib
from meshtrain.planner.hlo import collectives
from meshtrain.run.experiment import Experiment
from meshtrain.sampling import generate as gen
from support.sampling import N_NEW, greedy_by_recompute, make_prompts, peaky
from support.configs import configured

# Sequence parallelism too: Llama's cache [.., S, K, E] leaves tensor to `length` there.
LAYOUTS = [("data:2,context:4", "dp_cp"), ("data:2,context:2,tensor:2", "dp_tp_cp"), ("data:2,tensor:4", "dp_tp_sp")]


@pytest.fixture(scope="module", params=["gpt2_tiny_dp8", "llama_tiny_dp8"])
def reference(request):
    """A tiny model's peaky params, prompts and greedy tokens recomputed on one device."""
    cfg = config_lib.load(request.param)
    one = Experiment.build(cfg, devices=jax.devices()[:1], mesh_shape="data:1")
    params = jax.device_get(peaky(one.model.init_params(0)))
    prompts = make_prompts(np.random.default_rng(1), 3, one.model.cfg.vocab_size)
    expected = greedy_by_recompute(one.model, params, prompts, N_NEW)
    assert len({tuple(r) for r in expected}) == 3  # the context decides: the test can fail
    return dict(name=request.param, params=params, prompts=prompts, expected=expected)


def on(name: str, mesh: str, layout: str) -> Experiment:
    """configs/NAME.py on another mesh and layout."""
    return Experiment.build(configured(name, **{"mesh.shape": mesh, "layout": layout}))


@pytest.mark.parametrize("mesh, layout", LAYOUTS)
def test_greedy_with_cache_equals_recompute_under_context(reference, mesh, layout):
    exp = on(reference["name"], mesh, layout)
    fn = gen.make_generate(exp.model, exp.layout, exp.mesh, exp.shardings.params, max_new_tokens=N_NEW)
    params = jax.device_put(reference["params"], exp.shardings.params)
    out = gen.generate(fn, params, reference["prompts"], exp.layout, exp.mesh, temperature=0.0)
    np.testing.assert_array_equal(out, reference["expected"])


def test_cache_length_is_a_multiple_of_the_pieces_of_its_positions():
    gpt2 = on("gpt2_tiny_dp8", "data:2,tensor:4", "dp_tp_sp")
    llama = on("llama_tiny_dp8", "data:2,tensor:4", "dp_tp_sp")
    cp = on("gpt2_tiny_dp8", "data:2,context:4", "dp_cp")
    assert gen.cache_length(gpt2.model, gpt2.layout, gpt2.mesh, 17) == 17  # heads claim tensor
    assert gen.cache_length(llama.model, llama.layout, llama.mesh, 17) == 20  # its K heads do not
    assert [gen.cache_length(cp.model, cp.layout, cp.mesh, s) for s in (16, 17, 19)] == [16, 20, 20]


def test_the_cache_stays_split_over_context_while_decoding(reference):
    """The compiled generation under data:2,context:4, a prompt of 40, for 4 and for 24 new
    tokens: the decode loop gathers nothing (the all-gathers are the prefill's, a few per
    layer), and a step's all-reduces over context (per layer the softmax's max and sum and
    the weighted values of the one query; the last position's logits) send under a quarter
    of what gathering the cache would: each device keeps its S/4 positions."""
    exp = on(reference["name"], "data:2,context:4", "dp_cp")
    rows, p = 2, 40  # one row per data shard

    def stats(n_new):
        fn = gen.make_generate(exp.model, exp.layout, exp.mesh, exp.shardings.params, max_new_tokens=n_new)
        return collectives(gen.compile_generate(fn, exp.abstract_state().params, rows, p, exp.layout, exp.mesh))
    few, many = stats(4), stats(24)
    steps = 24 - 4
    # An all-gather in the loop would run once per step and layer: more than `steps` times.
    assert many["all-gather"].count < steps, many
    cfg = exp.model.cfg
    per_step = (many["all-reduce"].count - few["all-reduce"].count) / steps
    assert per_step >= 3 * cfg.num_layers, (few, many)  # every layer reduces over context
    kv_heads = getattr(cfg, "num_kv_heads", None) or cfg.num_heads
    # k and v of every layer for one row (rows / data), float32: what a gather would bring.
    cache_bytes = 2 * cfg.num_layers * (p + 24) * kv_heads * (cfg.embed_dim // cfg.num_heads) * 4
    per_step_bytes = (many["all-reduce"].bytes - few["all-reduce"].bytes) / steps
    assert per_step_bytes < cache_bytes / 4, (per_step_bytes, cache_bytes)
    print(f"{reference['name']}: a decode step under data:2,context:4 all-reduces {per_step:g} times, "
          f"{per_step_bytes:.0f} bytes; the cache of a row is {cache_bytes} bytes")
