"""Mixture of Experts: the shape of a model's expert layers (args), how a token picks its experts (routing),
and the layer (layer). No torch in args, so a job's checks read it without torch."""
