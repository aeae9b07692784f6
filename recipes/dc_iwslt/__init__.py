"""DynamicConv (Wu et al., 2019) on IWSLT'14 De→En: the model, beam search and checkpoint averaging."""
