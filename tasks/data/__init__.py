"""Datasets: the manifest, preparing text into tokens, and warming a dataset onto local disk."""
