"""Parallel VAE decode: the latent split by rows across the job's ranks, each convolution fed its neighbours'
rows, normalisation statistics reduced, attention given every row, the decoded rows gathered (model-agnostic;
patches/vaes.py says which modules of which VAE get which layer)."""
