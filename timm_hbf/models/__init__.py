"""Model families. Importing this package registers every model with timm."""
from .vit_hyperbf import VisionTransformerHyperBF

__all__ = ['VisionTransformerHyperBF']
