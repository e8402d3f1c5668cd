"""Model families. Importing this package registers every model with timm."""
from ._builder import PretrainedWeightsError
from .vit_hyperbf import VisionTransformerHyperBF
from .vit_qimia import VisionTransformerQimia

__all__ = ['PretrainedWeightsError', 'VisionTransformerHyperBF', 'VisionTransformerQimia']
