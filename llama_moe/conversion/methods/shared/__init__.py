"""Algorithms several construction methods share, imported when a method runs (nothing here is registered):
`importance.py`, neuron importance per token group and the splits built on it (`residual`, `sharing_inner`,
`sharing_inter`)."""
