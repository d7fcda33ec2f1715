"""Profiling: measure a workload's model parameters from real runs, fit them, and validate the fit."""
