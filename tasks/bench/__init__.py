"""Benchmarks (`spotfill bench NAME`): each drives a domain package at the sizes users run and
compares it with its physical reference. Above the domain packages, below the command line;
nothing in the domain imports them."""
