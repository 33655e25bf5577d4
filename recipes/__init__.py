"""The example recipes, their training scripts and data: shipped as package data (``broker init DIR`` writes
them out).  Not imported by broker itself; each script runs unchanged under torchrun."""
