"""Triton kernels. A kernel here knows shapes, strides and pointers, never models."""
