"""Recipes: the model, data, loss and evaluation of one task. ``lowmem`` knows none of them."""
