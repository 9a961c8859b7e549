"""The ``gradfleet`` command line: train and compare optimizers and distribution strategies."""
