"""triax: data x tensor x pipeline parallel transformer training in one JAX SPMD program."""

__version__ = '0.1.0'
