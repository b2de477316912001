"""VGG tiny on scikit-learn's 8x8 handwritten digits (1,797 real images, bundled with
scikit-learn: no download), upscaled to 16 px, on 2-way data parallelism: the README's
image run, about 98% top-1 on the 359 held-out digits in a few minutes on 2 CPU cores.

    python -m meshtrain.train --config=vgg_tiny_digits_dp2 --workdir=runs/digits
"""

from meshtrain.config import image_classification


def get_config():
    c = image_classification("vgg", "tiny", mesh="data:2", layout="dp")
    c.data.update(kind="images", name="digits", split="train", eval_split="test")
    # 1,438 training digits: 600 steps of 64 are ~27 epochs. The eval covers the 359
    # test digits exactly once (6 batches of 64, the padding rows left out).
    c.train.update(steps=600, batch_size=64, log_every=50, eval_every=200, eval_steps=6)
    c.optim.update(lr=0.05, warmup_steps=30)
    return c
