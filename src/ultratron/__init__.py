"""ultratron: train large language models from one laptop CPU to thousands of GPUs."""

__version__ = "0.1.0"
