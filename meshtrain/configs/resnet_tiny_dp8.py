"""ResNet tiny (a 3x3 stem, two basic blocks, BatchNorm, 16 px, 10 classes) on 8-way data
parallelism, on synthetic images whose best accuracy is known (90%); seconds per run on CPU.

    python -m meshtrain.train --config=resnet_tiny_dp8 --workdir=runs/resnet_tiny_dp8
"""

from meshtrain.config import image_classification


def get_config():
    return image_classification("resnet", "tiny", mesh="data:8", layout="dp")
