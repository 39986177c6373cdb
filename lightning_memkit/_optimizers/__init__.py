"""Optimizers: the catalogue and the swap (``swap``), and the choice of one that fits (``choice``)."""
