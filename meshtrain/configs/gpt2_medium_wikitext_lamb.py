"""The survey's GPT-2 recipe (Nichols et al. 2021, arXiv 2111.04949): GPT-2 medium (355M)
with LAMB, lr 1e-3, weight decay 0.01, 32 sequences of 1024 tokens per device, on 8-way
data parallelism (train.batch_size 256 = 8 x 32).

    python -m meshtrain.train --config=gpt2_medium_wikitext_lamb --workdir=runs/gpt2_medium_lamb

The survey trains on WikiText-103. The data here is the synthetic default; to read
WikiText-103, prepare its raw training text once (no network needed at run time; see
docs/data.md) and point the run at it:

    python -m meshtrain.data.prepare --input=wikitext-103-raw/wiki.train.raw \
        --name=wikitext103 --data_dir=D --tokenizer=gpt2
    python -m meshtrain.train --config=gpt2_medium_wikitext_lamb --config.data.kind=tfds \
        --config.data.name=wikitext103 --config.data.data_dir=D

Compile-only check on any machine (simulated devices on CPU):

    python -m meshtrain.train --config=gpt2_medium_wikitext_lamb --config.train.steps=0
"""

from meshtrain.config import gpt2_pretraining

DEVICES = 8
PER_DEVICE = 32  # sequences per device, the survey's


def get_config():
    # save_dots: with 32 x 1024 tokens per device the compiled step needs 163 GiB per device
    # without remat, 42 GiB with save_dots (XLA's estimate on simulated CPU devices).
    c = gpt2_pretraining(size="medium", mesh=f"data:{DEVICES}", layout="dp", lr=1e-3, remat="save_dots")
    c.train.batch_size = DEVICES * PER_DEVICE
    # LAMB's own b2 and eps (You et al. 2020), not the AdamW defaults of base().
    c.optim.update(name="lamb", weight_decay=0.01, b2=0.999, eps=1e-6)
    return c
