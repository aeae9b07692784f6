"""Any image classifier (torchvision's registry by name, or a user's class) on the image data sets."""
