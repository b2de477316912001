"""The survey's image recipe (Nichols et al. 2021, arXiv 2111.04949): VGG-16 (138,357,544
parameters, no BatchNorm) on ImageNet at 224 px, SGD with momentum 0.9, lr 0.01, weight
decay 1e-4, 64 images per device on 8-way data parallelism, 90 epochs.

With ImageNet prepared by TFDS (`tfds build imagenet2012` with the archives in its manual
directory) or a folder of class subfolders (`python -m meshtrain.data.prepare --images=DIR`):

    python -m meshtrain.train --config=vgg16_imagenet_dp8 --config.data.kind=images \\
        --config.data.name=imagenet2012 --config.data.data_dir=D

Without the data.* keys it reads synthetic 224 px images (throughput and compile checks):

    python -m meshtrain.train --config=vgg16_imagenet_dp8 --config.train.steps=0
"""

from meshtrain.config import image_classification

DEVICES, PER_DEVICE = 8, 64
IMAGENET_TRAIN = 1_281_167


def get_config():
    c = image_classification("vgg", "vgg16", mesh=f"data:{DEVICES}", layout="dp")
    c.model.update(dtype="bfloat16", dropout=0.5)  # the published classifier's dropout
    c.data.update(split="train", eval_split="validation")
    batch = DEVICES * PER_DEVICE
    c.train.update(batch_size=batch, steps=90 * IMAGENET_TRAIN // batch, log_every=100,
                   eval_every=5000, eval_steps=50_000 // batch + 1)
    # The survey's SGD (PyTorch's: L2 weight decay in the gradient, no clipping). Its
    # step decay (lr / 10 every 30 epochs) is not offered; cosine to 0 is the usual stand-in.
    c.optim.update(name="sgd", lr=0.01, min_lr=0.0, momentum=0.9, weight_decay=1e-4,
                   warmup_steps=0, grad_clip=0.0)
    return c
