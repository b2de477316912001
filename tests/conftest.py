"""Every test process gets 8 fake CPU devices, set before JAX starts its backend."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
