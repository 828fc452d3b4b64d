"""The composition root: the serving stack built from the flags."""
