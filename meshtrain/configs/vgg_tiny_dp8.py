"""VGG tiny (4 convs with BatchNorm, 16 px, 10 classes) on 8-way data parallelism, on
synthetic images whose best accuracy is known (90%); seconds per run on CPU.

    python -m meshtrain.train --config=vgg_tiny_dp8 --workdir=runs/vgg_tiny_dp8
"""

from meshtrain.config import image_classification


def get_config():
    return image_classification("vgg", "tiny", mesh="data:8", layout="dp")
