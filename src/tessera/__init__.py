"""tessera: train large transformers across devices and beyond device memory."""

__version__ = "0.1.0"
