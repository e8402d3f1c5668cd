"""Model families. Importing this package registers every model with timm."""
from ._builder import PretrainedWeightsError, read_weights, state_dict_mismatch
from .vit_attnres import *  # noqa: F403  (registers the AttnRes models)
from .vit_hyperbf import VisionTransformerHyperBF
from .vit_qimia import VisionTransformerQimia

__all__ = ['PretrainedWeightsError', 'VisionTransformerHyperBF', 'VisionTransformerQimia', 'read_weights',
           'state_dict_mismatch']
