"""Data constants shared by the model families."""

__all__ = ['CIFAR10_MEAN', 'CIFAR10_STD']

# CIFAR-10 training-set channel statistics: the normalisation in the pretrained_cfg of every 32 x 32 model
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
