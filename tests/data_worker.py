"""One process of the two-process data test (tests/test_tfds_data.py).

argv: process_id num_processes port data_dir out_dir [catalog]. Each process has 2 CPU
devices; the 4 form one `data` mesh axis. It reads its rows of 3 global batches
from the tfds source, builds the global array with
jax.make_array_from_process_local_data, gathers it (over gloo) and saves both.
With `catalog`, it opens the catalog dataset "sentences" in data_dir instead, which the
processes convert together into out_dir (meshtrain/data/catalog.py), and stops.
"""

import sys
from pathlib import Path

import jax
import numpy as np


def main(pid: int, n: int, port: str, data_dir: str, out: Path, mode: list[str]) -> None:
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=n, process_id=pid)

    import ml_collections
    from jax.sharding import NamedSharding, PartitionSpec as P

    from meshtrain.data import make_source

    if mode == ["catalog"]:
        cfg = ml_collections.ConfigDict(dict(kind="tfds", name="sentences", data_dir=data_dir, split="train",
                                             eval_split="test", feature="text", tokenizer="byte",
                                             cache_dir=str(out), workers=2))
        make_source(cfg, vocab_size=-1, seq_len=16, seed=0)
        jax.distributed.shutdown()
        return
    cfg = ml_collections.ConfigDict(dict(kind="tfds", name="corpus", data_dir=data_dir, split="train",
                                         eval_split="validation", feature="", tokenizer="byte"))
    source = make_source(cfg, vocab_size=-1, seq_len=16, seed=0)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rows = NamedSharding(mesh, P("data"))
    gather = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))
    it = source.train_batches(8, process_index=jax.process_index(), process_count=jax.process_count())
    for b in range(3):
        local = next(it)
        full = gather(jax.make_array_from_process_local_data(rows, local, (8, 17)))
        np.save(out / f"local_p{pid}_b{b}.npy", local)
        np.save(out / f"global_p{pid}_b{b}.npy", np.asarray(full.addressable_data(0)))
    jax.distributed.shutdown()


if __name__ == "__main__":  # the catalog conversion's workers are spawned: they import this file
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5]), sys.argv[6:])
