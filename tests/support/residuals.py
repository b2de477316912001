"""What a backward pass keeps: the residuals JAX saves between forward and backward."""

import contextlib
import io
import re

from jax.ad_checkpoint import print_saved_residuals


def saved(fn, *args) -> list[tuple[int, ...]]:
    """Shapes of the arrays the backward pass of fn(*args) keeps, as JAX prints them."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    return [tuple(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"^\w+\[([\d,]*)\]", out.getvalue(), re.M)]
