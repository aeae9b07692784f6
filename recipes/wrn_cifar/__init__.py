"""WideResNet on CIFAR-10 (and image data sets of the same shape)."""
