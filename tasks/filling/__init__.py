"""Inference filling: serve inference inside training's idle communication bubbles (SpecInF idea).

monitor -> where the bubbles are; gate -> when a chunk may start; scheduler -> which chunk;
guard -> how much of a bubble to use; executor -> where it runs; filler -> the loop tying them;
attach -> what the training runtime calls. Design: docs/filling.md.
"""
