"""Prefect flows: thin wrappers over the plain functions in tasks/."""
