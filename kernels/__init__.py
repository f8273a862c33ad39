"""pdd.kernels"""
