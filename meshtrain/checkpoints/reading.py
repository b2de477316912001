"""Reading a checkpoint's arrays into a run: its params (`load_params`, into any layout,
mesh or pipeline arrangement, cast and padded as the run's model wants), its BatchStat
statistics (`load_stats`), single leaves on the host (`read_leaf`, for exports), and the
step-0 state of an `init.from` run (`init_state`). The checkpoint is found and described
by meshtrain/checkpoints/init_from.py (`init_from.read` -> InitSource).

    src = init_from.read(cfg.init["from"])
    state = reading.init_state(src, exp)     # its params at step 0, fresh optimizer
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import tree_paths
from meshtrain.checkpoints import integrity, restage
from meshtrain.checkpoints import steps as steps_lib
from meshtrain.checkpoints.init_from import InitSource, check_model
from meshtrain.errors import UserError
from meshtrain.parallel.pipeline.scan import Pipeline, from_stages, to_stages


def saved_params(src: InitSource) -> dict:
    """{leaf path under params: ArrayMetadata (shape, dtype)} as stored."""
    import orbax.checkpoint as ocp
    handler = ocp.PyTreeCheckpointHandler()
    try:
        with _reading(src):
            return tree_paths.flat(handler.metadata(src.step_dir / "state").tree["params"])
    finally:
        handler.close()


def _reading(src: InitSource):
    """A failed read of `src` -> one UserError paragraph naming the step, the file and the
    step to pick instead (integrity.reading)."""
    return integrity.reading(src.step_dir, lambda: steps_lib.older_intact(src.step_dir))


def nest(flat: dict) -> dict:
    """{"a/b": x} -> {"a": {"b": x}} (the inverse of tree_paths.flat)."""
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        *parents, name = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = leaf
    return out


def _restore(src: InitSource, items: dict, args: dict, key: str = "params") -> dict:
    """Only the `key` (params, stats) leaves named in `items` ({path: placeholder}); flat result."""
    import orbax.checkpoint as ocp
    handler = ocp.PyTreeCheckpointHandler()
    try:
        with _reading(src):
            restored = handler.restore(src.step_dir / "state", args=ocp.args.PyTreeRestore(
                item={key: nest(items)}, restore_args={key: nest(args)}, partial_restore=True))
    finally:
        handler.close()
    return tree_paths.flat(restored[key])


def read_leaf(src: InitSource, path: str, stacked: str) -> np.ndarray:
    """One params leaf on the host, in model layer order ([L, ...] for stacked leaves)."""
    import orbax.checkpoint as ocp
    x = _restore(src, {path: 0}, {path: ocp.RestoreArgs(restore_type=np.ndarray)})[path]
    if src.pipeline is not None and path.startswith(stacked + "/"):
        x = from_stages(x, _pipe(src.pipeline))
    return x


def _pipe(arrangement) -> Pipeline:
    return Pipeline(stages=arrangement[0], microbatches=1, repeats=arrangement[1])


def load_params(src: InitSource, model, param_shardings):
    """The checkpoint's params for `model` (a state.ModelDef) in `param_shardings`: cast
    to model.param_dtype, vocabulary rows padded (or padding dropped) to the model's
    padded size, block stacks in its pipeline arrangement. Each process reads only its
    shards."""
    import orbax.checkpoint as ocp
    check_model(src, model.cfg)
    saved = saved_params(src)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    shapes, axes = tree_paths.flat(model.shapes), tree_paths.flat(model.axes, is_leaf=is_axes)
    shardings = tree_paths.flat(param_shardings)
    if set(saved) != set(shapes):
        gone, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
        raise UserError(f"init.from={str(src.step_dir)!r} does not hold this model's params: "
                        f"missing {gone or 'none'}, unexpected {extra or 'none'}. It is not a "
                        f"complete {src.family} checkpoint; convert or save it again.")
    current = restage.arrangement(model.pipeline)
    dtype = jnp.dtype(model.cfg.param_dtype)
    items, args, plans = {}, {}, {}
    for path, want in shapes.items():
        stacked = model.stacked is not None and path.startswith(model.stacked + "/")
        # Leading layer dims: [L] or [S, L/S] in the run and in the checkpoint.
        run_lead = (2 if current else 1) if stacked else 0
        saved_lead = (2 if src.pipeline else 1) if stacked else 0
        got = tuple(saved[path].shape)
        inner_names, run_inner, saved_inner = axes[path][run_lead:], want.shape[run_lead:], got[saved_lead:]
        spec = tuple(shardings[path].spec) + (None,) * len(want.shape)
        inner_spec = list(spec[run_lead:len(want.shape)])
        same_layers = np.prod(want.shape[:run_lead]) == np.prod(got[:saved_lead])
        if not same_layers or len(run_inner) != len(saved_inner):
            raise UserError(f"init.from={str(src.step_dir)!r}: {path} is saved as {list(got)}, "
                            f"this run's model has {list(want.shape)}. {src.source} does not "
                            f"fit this model.")
        for i, (name, a, b) in enumerate(zip(inner_names, run_inner, saved_inner)):
            if a == b:
                continue
            if name != "vocab" and not (name == "length" and b > a):
                raise UserError(f"init.from={str(src.step_dir)!r}: {path} is saved as "
                                f"{list(got)}, this run's model has {list(want.shape)} ({name} "
                                f"differs). {src.source} does not fit this model.")
            inner_spec[i] = None  # read whole, then cut or padded to the run's size
        # Saved in another arrangement: read, then restacked on device (restage.py). Saved
        # [L, ...] for a pipelined run is read with L split like the stages, so with one
        # repeat each device reads just its stage's layers; otherwise layer dims are unsplit.
        if src.pipeline == current:
            lead_spec = spec[:run_lead]
        else:
            lead_spec = spec[:1] if stacked and src.pipeline is None else (None,) * saved_lead
        sharding = NamedSharding(shardings[path].mesh, P(*lead_spec, *inner_spec))
        items[path] = jax.ShapeDtypeStruct(got, dtype, sharding=sharding)
        args[path] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=got, dtype=dtype)
        plans[path] = (stacked, run_lead, run_inner)
    restored = _restore(src, items, args)
    # Leaves read in their final shape and sharding are done; the rest (vocabulary,
    # positions, another pipeline arrangement) are cut, padded or restacked on device.
    todo = {p for p, a in restored.items() if a.shape != shapes[p].shape or a.sharding != shardings[p]}

    def fit(flat):
        out = {}
        for path, x in flat.items():
            stacked, lead, sizes = plans[path]
            if stacked and src.pipeline != current:
                x = x if src.pipeline is None else from_stages(x, _pipe(src.pipeline))
                x = x if current is None else to_stages(x, _pipe(current))
            for i, size in enumerate(sizes, start=lead):
                if x.shape[i] > size:  # padding rows of a padded table, or positions
                    x = jax.lax.slice_in_dim(x, 0, size, axis=i)
                elif x.shape[i] < size:  # padding rows are zero, as models initialise them
                    x = jnp.pad(x, [(0, size - x.shape[i]) if j == i else (0, 0) for j in range(x.ndim)])
            out[path] = x
        return out
    fitted = jax.jit(fit, out_shardings={p: shardings[p] for p in todo})({p: restored[p] for p in todo})
    return nest({p: fitted[p] if p in todo else restored[p] for p in shapes})


def load_stats(src: InitSource, model, stats_shardings) -> dict:
    """The checkpoint's BatchStat state (BatchNorm's running statistics) for `model`, in
    `stats_shardings`: saved as the model has them ({} for a model without)."""
    import orbax.checkpoint as ocp
    shapes, shardings = tree_paths.flat(model.stats_shapes), tree_paths.flat(stats_shardings)
    if not shapes:
        return {}
    items = {p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[p]) for p, s in shapes.items()}
    args = {p: ocp.ArrayRestoreArgs(sharding=shardings[p], global_shape=s.shape, dtype=s.dtype)
            for p, s in shapes.items()}
    return nest(_restore(src, items, args, key="stats"))


def init_state(src: InitSource, exp):
    """TrainState at step 0: `src`'s params (load_params) and statistics (load_stats), a
    fresh optimizer state and reduction state, the run's seed; in exp.shardings."""
    from meshtrain.step import state as state_lib
    params = load_params(src, exp.model, exp.shardings.params)
    stats = load_stats(src, exp.model, exp.shardings.stats)

    def init(p, s):
        return state_lib.TrainState(step=jnp.zeros((), jnp.int32), rng=state_lib.base_key_data(exp.cfg.train.seed),
                                    params=p, opt_state=exp.tx.init(p), stats=s)
    state = jax.jit(init, out_shardings=exp.shardings.replace(comm={}), donate_argnums=(0, 1))(params, stats)
    return state.replace(comm=exp.fresh_comm(state.params))
