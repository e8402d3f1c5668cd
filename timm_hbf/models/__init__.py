"""Model families. Importing this package registers every model with timm."""
from .vit_hyperbf import VisionTransformerHyperBF
from .vit_qimia import VisionTransformerQimia

__all__ = ['VisionTransformerHyperBF', 'VisionTransformerQimia']
