"""VGG tiny on 2-way data parallelism x 4-way spatial partitioning: each image's rows are
split over the 4 devices of `tensor` (layout dp_spatial), and every conv exchanges its
k//2 boundary rows with the neighbouring devices (XLA inserts the collective-permutes;
`meshtrain plan` sets their bytes beside the halo formula).

    python -m meshtrain.train --config=vgg_tiny_dp2_spatial4
    python -m meshtrain.plan --config=vgg_tiny_dp2_spatial4
"""

from meshtrain.config import image_classification


def get_config():
    return image_classification("vgg", "tiny", mesh="data:2,tensor:4", layout="dp_spatial")
