"""Measurements of trained models: curvature of the loss, gradient dissimilarity across clients."""
