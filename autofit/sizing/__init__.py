"""Sizing: the largest model of a family that trains within a budget, from profiles extrapolated across sizes."""
