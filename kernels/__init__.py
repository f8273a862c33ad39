"""Attention kernels for MainDecode.

Modules are imported explicitly: ``reference`` is pure torch, ``extend_attention`` imports
Triton, which decides at kernel-definition time whether to use its CPU interpreter.
"""
