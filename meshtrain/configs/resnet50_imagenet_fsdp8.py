"""ResNet-50 (25,557,032 parameters) on ImageNet at 224 px, FSDP over 8 devices: the
Goyal et al. recipe (arXiv 1706.02677): SGD with Nesterov-free momentum 0.9, lr 0.1 per
256 images scaled linearly with the batch, 5 warm-up epochs, weight decay 1e-4, 90 epochs.

    python -m meshtrain.train --config=resnet50_imagenet_fsdp8 --config.data.kind=images \\
        --config.data.name=imagenet2012 --config.data.data_dir=D

Without the data.* keys it reads synthetic 224 px images:

    python -m meshtrain.train --config=resnet50_imagenet_fsdp8 --config.train.steps=0
"""

from meshtrain.config import image_classification

DEVICES, PER_DEVICE = 8, 64
IMAGENET_TRAIN = 1_281_167


def get_config():
    c = image_classification("resnet", "resnet50", mesh=f"fsdp:{DEVICES}", layout="fsdp")
    c.model.dtype = "bfloat16"
    c.data.update(split="train", eval_split="validation")
    batch = DEVICES * PER_DEVICE
    epoch = IMAGENET_TRAIN // batch
    c.train.update(batch_size=batch, steps=90 * epoch, log_every=100, eval_every=5000,
                   eval_steps=50_000 // batch + 1)
    c.optim.update(name="sgd", lr=0.1, lr_batch_size=256, min_lr=0.0, momentum=0.9,
                   weight_decay=1e-4, warmup_steps=5 * epoch, grad_clip=0.0)
    return c
