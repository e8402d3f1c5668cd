"""HyperBF and QIMIA Vision Transformers for timm.

``import timm_hbf`` registers the model families with timm's registry, after which ``timm.create_model`` builds them
like any timm model.
"""
from . import layers, models

__version__ = '0.3.0'

__all__ = ['layers', 'models', '__version__']
